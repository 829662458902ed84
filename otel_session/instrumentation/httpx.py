"""httpx and httpx2 (what the openai SDK uses): the session on every hop, for that hop only.

A hop is planned at the last point before the socket, where its destination is final. For httpx's own
transport that is ``HTTPTransport.handle_request`` (and the async twin): it dials the request's URL as
it is, once per hop (every redirect and retry), so the hop is planned there for that URL and sent as a
stand-in for the caller's ``Request`` with headers of its own. The client above it (its cookie jar,
its logging) never sees ours, and pays nothing for them.

A transport of any other class (a test double, an in-process app, one that re-targets requests or
wraps another) may never reach ``HTTPTransport``: every such class is patched too, when instrumenting
(those that exist) or when a client is built (those defined since). It plans the hop for the URL it
was handed and sends a copy of ours; a transport of ours that receives that copy for another URL
(re-targeted on the way) plans it again. A request called by name (``handle_request(request=...)``)
is planned like one passed by position.

The caller's object is never edited, so the same ``Request`` sent by two trajectories (or threads) at
once carries each its own ID, and the redirect httpx builds from it carries nothing of ours.
"""

from __future__ import annotations

import inspect
from types import ModuleType
from typing import Any

from otel_session import _carriers, _faults, _hop, _propagator
from otel_session._instrumentor import SessionInstrumentor, Wrapper

# Hops planned by a transport other than httpx's own, in flight: id(our copy sent) -> (that copy; the
# destination it was planned for; the caller's own headers). Never the caller's own object, which
# another hop may be sending at the same moment.
_in_flight: dict[int, tuple[Any, _hop.Destination, Any]] = {}
_STOCK_METHODS = ("handle_request", "handle_async_request")
# Request classes whose library's own transport reads no attribute of a request beyond what
# ``_carriers.request_for_transport`` sets (checked on its code when patching): sent as such a
# stand-in there. Any other (a subclass, a transport that reads more) is sent as a full copy.
_stand_ins_for: set[type] = set()


def _transport_reads_only_the_basics(module: ModuleType) -> bool:
    """Whether httpx's own transports read, of a ``Request``, only ``_carriers.TRANSPORT_READS``."""
    try:
        probe = module.Request("GET", "http://localhost")
        attributes = {name for name in dir(probe) if not name.startswith("__")} | set(vars(probe))
        for method in (module.HTTPTransport.handle_request, module.AsyncHTTPTransport.handle_async_request):
            names = set(inspect.unwrap(method).__code__.co_names)  # under any wrapper already on it
            if not names & attributes <= _carriers.TRANSPORT_READS:
                return False
        return True
    except Exception:
        return False


# URL classes whose instances keep the parsed URL as ``_uri_reference`` with ``scheme``, ``host`` and
# ``port`` exactly as the public properties give them (checked when patching): read there, three
# property calls fewer on every request. A host with an IDNA label is left to the property, which
# decodes it.
_parsed_urls: set[type] = set()
_URL_PROBES = ("http://127.0.0.1:8000/v1", "HTTPS://Router.EXAMPLE/x", "http://[::1]:9/", "https://h:443/")


def _url_keeps_its_parts(module: ModuleType) -> bool:
    """Whether ``module.URL`` keeps scheme, host and port in ``_uri_reference`` as its properties say."""
    try:
        for text in _URL_PROBES:
            url = module.URL(text)
            parsed = url._uri_reference
            if (parsed.scheme, parsed.host, parsed.port) != (url.scheme, url.host, url.port):
                return False
        return True
    except Exception:
        return False


def _destination(url: Any) -> _hop.Destination:
    """Where a request to ``url`` goes: (scheme, host, port) as ``url``'s properties give them."""
    if type(url) in _parsed_urls:
        parsed = url._uri_reference
        if "xn--" not in parsed.host:
            return parsed.scheme, parsed.host, parsed.port
    return url.scheme, url.host, url.port


def _plan(headers: Any, destination: _hop.Destination) -> _hop.Prepared | None:
    """The hop of a request with ``headers`` to ``destination``, planned; ``None``: nothing could be
    added (see ``_hop.now``: the usual request outside a trajectory never reads its URL).

    A stock propagator composed with ours may have written our values already (an upstream
    instrumentation above this hook injecting through it): then what is recognisably ours is taken
    back where it must not go.
    """
    now = _hop.now()
    if now is None:
        return None
    return _hop.prepare(now, headers, *destination, _propagator.is_sole_global())


def _registered(request: Any) -> tuple[Any, _hop.Destination, Any] | None:
    """``request``'s entry in ``_in_flight`` if it is a copy of ours in flight: (that copy, the
    destination it was planned for, the caller's own headers)."""
    entry = _in_flight.get(id(request))
    return entry if entry is not None and entry[0] is request else None


def _at_transport(request: Any) -> Any:
    """What httpx's own transport sends for ``request``: planned here, for the URL it dials, unless a
    transport above planned it (then planned again only if that transport sent it elsewhere).

    The usual request takes the express path: the plan remembered for its context and destination
    (``_hop.plans_now``), valid while it holds none of the names the policy reads. The first hop of a
    context to a destination is planned, remembered, and then sent the same way, so a trajectory's
    first request runs the code its next ones run. Anything else is planned and sent in full.
    """
    try:
        prepared = None
        if _in_flight:
            entry = _registered(request)
            if entry is not None:
                return _replan_if_moved(request, entry)
        else:
            plans = _hop.plans_now()
            if plans is None:
                return request  # nothing to add from this context: its URL is not even read
            destination = _destination(request.url)
            known = plans.get(destination)
            if known is None:
                prepared = _plan(request.headers, destination)  # remembered unless it holds ours
                known = plans.get(destination)
            if known is not None:
                if known.entries is not None:
                    if type(request) in _stand_ins_for:
                        sent = _carriers.stand_in(request, known.names[1], known.entries)
                        if sent is not None:
                            if known.note is not None:
                                known.taken()
                            return sent
                elif not known.prepared.edits and known.fits(request.headers, _propagator.is_sole_global()):
                    return request
        if prepared is None:
            prepared = _plan(request.headers, _destination(request.url))
        if prepared is None or not prepared.edits:
            return request
        if type(request) in _stand_ins_for:
            return _carriers.request_for_transport(request, prepared.edits, prepared.held)
        return _carriers.copy_request(request, prepared.edits, prepared.held)
    except Exception as exc:  # a bug of ours must not fail the request
        _faults.report("adding session headers to a request", exc)
        return request


def _replan_if_moved(request: Any, entry: tuple[Any, _hop.Destination, Any]) -> Any:
    """Our copy, planned again if a transport changed where it goes after we planned it: the
    caller's headers with what the new destination may receive (edited in place: it is ours)."""
    destination = _destination(request.url)
    if destination == entry[1]:
        return request
    callers = entry[2]
    headers = _carriers.copy_headers(callers)
    again = _plan(callers, destination)
    if again is not None:
        _carriers.apply(headers, again.edits, held=again.held)
    request.headers = headers
    _in_flight[id(request)] = (request, destination, callers)
    return request


def _begin_elsewhere(request: Any) -> tuple[Any, int] | None:
    """A hop through a transport that may not be httpx's own: (our copy to send, its in-flight key);
    ``None``: send what it was handed (nothing of ours to add, or a copy a transport wrapping this
    one made, planned again here if that one sent it elsewhere)."""
    try:
        if _in_flight:
            entry = _registered(request)
            if entry is not None:
                _replan_if_moved(request, entry)
                return None
        destination = _destination(request.url)
        prepared = _plan(request.headers, destination)
        if prepared is None or not prepared.edits:
            return None  # the caller's own object, as it is: any transport it reaches plans it afresh
        sent = _carriers.copy_request(request, prepared.edits, prepared.held)
        key = id(sent)
        _in_flight[key] = (sent, destination, request.headers)
        return sent, key
    except Exception as exc:  # a bug of ours must not fail the request
        _faults.report("adding session headers to a request", exc)
        return None


def _request_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The request a transport method was called with, by position or by name (``None``: neither)."""
    return args[0] if args else kwargs.get("request")


def _with_request(
    args: tuple[Any, ...], kwargs: dict[str, Any], request: Any
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The same call with ``request`` in place of the one it had."""
    if args:
        return (request, *args[1:]), kwargs
    return args, {**kwargs, "request": request}


def _handle_request(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if len(args) == 1 and not kwargs:  # as httpx calls it: no argument tuple to rebuild
        return wrapped(_at_transport(args[0]))
    request = _request_of(args, kwargs)
    if request is not None:
        args, kwargs = _with_request(args, kwargs, _at_transport(request))
    return wrapped(*args, **kwargs)


async def _handle_async_request(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    request = _request_of(args, kwargs)
    if request is not None:
        args, kwargs = _with_request(args, kwargs, _at_transport(request))
    return await wrapped(*args, **kwargs)


def _handle_elsewhere(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    request = _request_of(args, kwargs)
    begun = _begin_elsewhere(request) if request is not None else None
    if begun is None:
        return wrapped(*args, **kwargs)
    try:
        sent_args, sent_kwargs = _with_request(args, kwargs, begun[0])
        return wrapped(*sent_args, **sent_kwargs)
    finally:
        _in_flight.pop(begun[1], None)


async def _handle_elsewhere_async(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    request = _request_of(args, kwargs)
    begun = _begin_elsewhere(request) if request is not None else None
    if begun is None:
        return await wrapped(*args, **kwargs)
    try:
        sent_args, sent_kwargs = _with_request(args, kwargs, begun[0])
        return await wrapped(*sent_args, **sent_kwargs)
    finally:
        _in_flight.pop(begun[1], None)


class HTTPXSessionInstrumentor(SessionInstrumentor):
    """Session headers for httpx's ``Client`` and ``AsyncClient`` (entry point ``otel_session_httpx``)."""

    library = "httpx"
    requirement = "httpx >= 0.23"

    _module: ModuleType | None = None
    _client_hook: Wrapper | None = None

    def targets(self, module: ModuleType) -> list[tuple[Any, str, Wrapper]]:
        self._module = module
        if _transport_reads_only_the_basics(module):
            _stand_ins_for.add(module.Request)
        if _url_keeps_its_parts(module):
            _parsed_urls.add(module.URL)
        if self._client_hook is None:
            self._client_hook = self._client_built  # one object, for patching to recognise
        return [
            (module.HTTPTransport, "handle_request", _handle_request),
            (module.AsyncHTTPTransport, "handle_async_request", _handle_async_request),
            (module.Client, "__init__", self._client_hook),
            (module.AsyncClient, "__init__", self._client_hook),
            *_other_transports(module),
        ]

    def _client_built(
        self, wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Transport classes defined since instrumenting are patched as a client is built: every
        subclass of httpx's transport bases (the client's, and any it may wrap), and the classes of
        the client's own transports, which need not be subclasses."""
        built = wrapped(*args, **kwargs)
        try:
            module = self._module
            if module is not None:
                found = _other_transports(module)
                for transport in (instance._transport, *instance._mounts.values()):
                    if transport is not None:
                        for kind in type(transport).__mro__:
                            found.extend(_elsewhere(kind, module))
                for owner, name, wrapper in found:
                    self.patch(owner, name, wrapper)  # a no-op for those patched already
        except Exception as exc:  # a client we cannot look into is sent as it is, never broken
            _faults.report(f"instrumenting a {self.library} transport", exc)
        return built


def _other_transports(module: ModuleType) -> list[tuple[Any, str, Wrapper]]:
    """The methods to patch of every transport class the process has defined, but httpx's own."""
    found: list[tuple[Any, str, Wrapper]] = []
    for base in (module.BaseTransport, module.AsyncBaseTransport):
        pending = list(base.__subclasses__())
        while pending:
            kind = pending.pop()
            pending.extend(kind.__subclasses__())
            found.extend(_elsewhere(kind, module))
    return found


def _elsewhere(kind: type, module: ModuleType) -> list[tuple[Any, str, Wrapper]]:
    """The methods of transport class ``kind`` to patch: the ones it defines itself, unless it is one
    of httpx's own (patched apart) or one of the base classes."""
    apart = (module.HTTPTransport, module.AsyncHTTPTransport, module.BaseTransport, module.AsyncBaseTransport)
    if kind in apart:
        return []
    own = kind.__dict__
    return [
        (kind, name, wrapper)
        for name, wrapper in zip(_STOCK_METHODS, (_handle_elsewhere, _handle_elsewhere_async), strict=True)
        if callable(own.get(name))
    ]


class HTTPX2SessionInstrumentor(HTTPXSessionInstrumentor):
    """The same for httpx2, the httpx fork the openai SDK uses (entry point ``otel_session_httpx2``)."""

    library = "httpx2"
    requirement = "httpx2"
