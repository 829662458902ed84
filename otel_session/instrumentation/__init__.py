"""otel-session's instrumentors, one module per instrumented library, each a ``BaseInstrumentor``.

They are registered once, as entry points in the ``opentelemetry_instrumentor`` group of
``pyproject.toml``: ``configure()`` loads them from there, as ``opentelemetry-instrument`` does, and
``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS`` names them there. The library's core never imports this
package; an instrumentation module imports the core.
"""
