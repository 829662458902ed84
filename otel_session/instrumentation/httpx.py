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
once carries each its own ID, and the redirect httpx builds from it carries nothing of ours. (Over
300 lines: httpx's own transport and every other transport class, and the checked fast paths into
httpx's header list and URL that keep the usual request cheap.)
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Awaitable, Callable
from types import ModuleType
from typing import Any

from otel_session import _carriers, _evidence, _faults, _gathering, _hop, _metrics, _propagator
from otel_session._policy import Edit
from otel_session.instrumentation._base import ProbedTypes, SessionInstrumentor, Wrapper

# Hops planned by a transport other than httpx's own, in flight: id(our copy sent) -> (that copy; the
# destination it was planned for; the caller's own headers). Never the caller's own object, which
# another hop may be sending at the same moment.
_in_flight: dict[int, tuple[Any, _hop.Destination, Any]] = {}
_STOCK_METHODS = ("handle_request", "handle_async_request")
# What httpx's own transports read of a request (checked on their code when patching): a request of
# a class in ``_stand_ins_for`` is sent there as a stand-in with just these attributes (``_stand_in``).
TRANSPORT_READS = frozenset({"method", "url", "headers", "stream", "extensions"})
_stand_ins_for: set[type] = set()
_LOWER_NAME = operator.itemgetter(1)
_NOTHING: dict[str, str] = {}


def _transport_reads_only_the_basics(module: ModuleType) -> bool:
    """Whether httpx's own transports read, of a ``Request``, only ``TRANSPORT_READS``."""
    try:
        probe = module.Request("GET", "http://localhost")
        attributes = {name for name in dir(probe) if not name.startswith("__")} | set(vars(probe))
        for method in (module.HTTPTransport.handle_request, module.AsyncHTTPTransport.handle_async_request):
            names = set(inspect.unwrap(method).__code__.co_names)  # under any wrapper already on it
            if not names & attributes <= TRANSPORT_READS:
                return False
        return True
    except Exception:
        return False


def _headers_are_listed(kind: type) -> bool:
    """Whether ``kind``'s instances keep ``_list`` and ``_encoding`` (and nothing else) as
    ``_copy_headers`` and ``_held`` expect, checked on a probe with a repeated name."""
    try:
        probe = kind([("X-Probe", "1"), ("Other", "2"), ("x-PROBE", "3")])
        expected = [
            (b"X-Probe", b"x-probe", b"1"),
            (b"Other", b"other", b"2"),
            (b"x-PROBE", b"x-probe", b"3"),
        ]
        if probe._list != expected or sorted(vars(probe)) != ["_encoding", "_list"]:
            return False
        copy: Any = object.__new__(kind)
        copy._list = [*probe._list, (b"New", b"new", b"4")]
        copy._encoding = probe._encoding
        del copy["X-PROBE"]
        return bool(
            copy._list == [(b"Other", b"other", b"2"), (b"New", b"new", b"4")]
            and copy.get("new") == "4"
            and probe.get("x-probe") == "1, 3"
        )
    except Exception:
        return False


# ``Headers`` classes whose instances keep ``_list`` as (raw name, lower-case name, value) byte triples
# and ``_encoding``, and nothing else: read and copied through ``_list``. (Every public lookup of a
# ``Headers`` first decodes every header to find its encoding.)
_LISTED = ProbedTypes(_headers_are_listed)


def _held(headers: Any, plan: _hop.Plan) -> dict[str, str]:
    """What ``headers`` hold of the names ``plan`` reads (``_NOTHING``, the usual case, without a
    Python loop over a listed ``Headers``)."""
    if type(headers) in _LISTED and plan.raw_names.isdisjoint(map(_LOWER_NAME, headers._list)):
        return _NOTHING
    return _carriers.read(headers, plan.names)


def _copy_headers(headers: Any, edits: list[Edit] | None = None, wire: Any = None) -> Any:
    """A copy of ``headers`` with ``edits`` made (``wire``: the same as byte triples to append, for a
    copy holding none of them)."""
    if type(headers) in _LISTED:
        copy: Any = object.__new__(type(headers))
        copy._list = headers._list + list(wire) if wire is not None else list(headers._list)
        copy._encoding = headers._encoding
        if wire is not None:
            return copy
    else:
        copy = headers.copy()
    if edits:
        _carriers.apply(copy, edits)
    return copy


def _stand_in(request: Any, headers: Any) -> Any:
    """What httpx's own transport sends in place of ``request``: ``TRANSPORT_READS`` of it, set
    directly (never reading the caller's ``__dict__``, which would make every later read of the
    caller's object slower), with ``headers``."""
    clone = object.__new__(type(request))
    clone.method, clone.url, clone.stream = request.method, request.url, request.stream
    clone.extensions = request.extensions
    clone.headers = headers
    return clone


def _copy_request(request: Any, headers: Any) -> Any:
    """A shallow copy of ``request`` (same body, same extensions, a caller's own attributes too) with
    ``headers``, built attribute by attribute in the original's order (a ``__dict__.update`` would
    give the copy a materialised dict, slower on every later read)."""
    clone = object.__new__(type(request))
    attributes = request.__dict__
    for key, value in attributes.items():
        setattr(clone, key, headers if key == "headers" else value)
    if "headers" not in attributes:
        clone.headers = headers
    return clone


# URL classes whose instances keep the parsed URL as ``_uri_reference`` with ``scheme``, ``host`` and
# ``port`` exactly as the public properties give them (checked when patching): read there, three
# property calls fewer on every request. A host with an IDNA label is left to the property.
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


def _over_unix_socket(transport: Any) -> bool:
    """Whether ``transport`` (httpx's own) sends over a Unix socket (``uds=``), not to the URL's host."""
    return getattr(getattr(transport, "_pool", None), "_uds", None) is not None


def _planned(offered: _hop.Offered, headers: Any, destination: _hop.Destination) -> tuple[_hop.Plan, Any]:
    """The plan for a request with ``headers`` to ``destination``, and what it holds of its names.

    A stock propagator composed with ours may have written our values already (an upstream
    instrumentation above this hook injecting through it): then what is recognisably ours is taken
    back where it must not go.
    """
    plan = offered.plan(*destination)
    held = _held(headers, plan)
    if held:
        plan = plan.given(held, _propagator.is_sole_global())
    return plan, held


def _body_of(request: Any) -> bytes | bytearray | None:
    """``request``'s body where it was given in full (``content=``, ``json=``, ``data=``, as the
    openai SDK sends); a streamed body is never read."""
    try:
        body = request.content  # httpx's own check: a body not read in full (a stream) raises
    except Exception:
        return None
    return body if isinstance(body, (bytes, bytearray)) else None


def _decided(offered: _hop.Offered, request: Any, destination: _hop.Destination) -> _hop.Offered:
    """What the context offers once a request to a router decided its attempt's group from the
    prompt in ``request``'s body (a streamed one names no group). Another host decides nothing."""
    if offered.plan(*destination).route.profile is None:
        return offered
    return offered.decide(_body_of(request), destination)


_Gathering = list[tuple[_hop.Offered, "_gathering.Body", _hop.Destination]]


def _at_transport(transport: Any, request: Any, gathering: _Gathering | None = None) -> Any:
    """What httpx's own transport sends for ``request``: planned here, for the URL it dials (nothing
    over a Unix socket), unless a transport above planned it (then planned again only if that
    transport sent it elsewhere). The caller's ``Request`` is never edited. An attempt's first
    request in a first step waits for its step (``_gathering``): here, in a thread (``gathering``
    ``None``); an async one is put in ``gathering`` and ``request`` returned unplanned."""
    try:
        if _in_flight:
            entry = _registered(request)
            if entry is not None:
                return _replan_at(request, entry, _where(transport, request))
        offered = _hop.current()
        if offered is None:
            if _hop.untold:  # until a request to a router outside any trajectory has been told of
                _hop.outside(*_destination(request.url))
            if _metrics.recording():
                _metrics.outside(*_destination(request.url))
            return request  # nothing to add from this context
        destination = _where(transport, request)
        if _gathering.may_wait(offered):  # an attempt's first request (its group still to read), or
            # one under a parent whose turn at the router has not come (``_pacing``)
            if gathering is None:
                offered = _gathering.gather_here(offered, _body_of(request), destination)
            elif _gathering.gathers(offered, destination):
                gathering.append((offered, _body_of(request), destination))
                return request
            offered = _decided(offered, request, destination)
        plan, held = _planned(offered, request.headers, destination)
        if not plan.edits:
            return request
        plan.delivered()
        headers = _copy_headers(request.headers, plan.edits, None if held else plan.wire)
        if type(request) in _stand_ins_for:
            return _stand_in(request, headers)
        return _copy_request(request, headers)
    except Exception as exc:  # a bug of ours must not fail the request
        _faults.report("adding session headers to a request", exc)
        return request


def _registered(request: Any) -> tuple[Any, _hop.Destination, Any] | None:
    """``request``'s entry in ``_in_flight`` if it is a copy of ours in flight."""
    entry = _in_flight.get(id(request))
    return entry if entry is not None and entry[0] is request else None


_UNIX: _hop.Destination = ("unix", None, None)  # a Unix socket: a local process, nobody's URL host


def _where(transport: Any, request: Any) -> _hop.Destination:
    """Where httpx's own ``transport`` really sends ``request``."""
    return _UNIX if _over_unix_socket(transport) else _destination(request.url)


def _replan_at(request: Any, entry: tuple[Any, _hop.Destination, Any], destination: _hop.Destination) -> Any:
    """Our copy, as a transport above planned it, reaching ``destination``: planned again from the
    caller's values of the names a hop reads if it goes elsewhere than planned (re-targeted, or over
    a Unix socket), keeping what the transports above added on the way, and
    edited in place (it is ours). Where stock propagators are composed with ours, an upstream
    instrumentation may have injected into it on the way: what is recognisably ours is taken back."""
    if destination == entry[1]:
        if not _propagator.is_sole_global():
            offered = _hop.current()
            if offered is not None:
                plan = offered.plan(*destination)
                held = _held(request.headers, plan)
                if held:
                    _carriers.apply(request.headers, plan.given(held, False).edits)
        return request
    callers = entry[2]
    offered = _hop.current()
    if offered is None:
        headers = _copy_headers(callers)
    else:
        # What the transports above added on the way stays; only the names the two hops read go
        # back to the caller's values before the hop is planned for where it really goes.
        headers = _copy_headers(request.headers)
        plan, _ = _planned(offered, callers, destination)
        names = {*offered.plan(*entry[1]).names, *plan.names}
        for name in names:
            _carriers.remove(headers, name)
        _carriers.apply(headers, [*_carriers.read(callers, names).items(), *plan.edits])
        if plan.edits:
            plan.delivered()
    request.headers = headers
    _in_flight[id(request)] = (request, destination, callers)
    return request


def _begin_elsewhere(
    request: Any, gathering: _Gathering | None = None
) -> tuple[Any, tuple[Any, _hop.Destination, Any]] | None:
    """A hop through a transport that may not be httpx's own: (our copy to send, its in-flight entry,
    registered by the caller while it is sent); ``None``: send what it was handed (nothing of ours to
    add, or a copy a transport wrapping this one made, planned again here if that one sent it
    elsewhere, or an attempt's first request put in ``gathering`` to wait for its step)."""
    try:
        if _in_flight:
            entry = _registered(request)
            if entry is not None:
                _replan_at(request, entry, _destination(request.url))
                return None
        offered = _hop.current()
        if offered is None:
            return None
        destination = _destination(request.url)
        if _gathering.may_wait(offered):
            if gathering is None:
                offered = _gathering.gather_here(offered, _body_of(request), destination)  # off a loop
            elif _gathering.gathers(offered, destination):
                gathering.append((offered, _body_of(request), destination))
                return None
            offered = _decided(offered, request, destination)
        plan, held = _planned(offered, request.headers, destination)
        if not plan.edits:
            return None  # the caller's own object, as it is: any transport it reaches plans it afresh
        plan.delivered()
        sent = _copy_request(request, _copy_headers(request.headers, plan.edits, None if held else plan.wire))
        return sent, (sent, destination, request.headers)
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
    """The hop planned, sent, and an error answer to a hop we added to noted (``_evidence``)."""
    if len(args) == 1 and not kwargs:  # as httpx calls it: no argument tuple to rebuild
        request = args[0]
        sent = _at_transport(instance, request)
        response = wrapped(sent)
    else:
        request = _request_of(args, kwargs)
        sent = request
        if request is not None:
            sent = _at_transport(instance, request)
            args, kwargs = _with_request(args, kwargs, sent)
        response = wrapped(*args, **kwargs)
    if sent is not request and response.status_code >= 429:  # a hop of ours, maybe an error answer
        _answered(response, sent)
    return response


def _handle_async_request(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The async twin of ``_handle_request``: planning needs no awaiting, so the original is called
    here and its coroutine returned, as unpatched (a call it refuses fails at once); a hop we added
    to is awaited in a coroutine of ours, to see its answer's status. A first step's first request
    of an attempt waits for its step to gather first (``_gathering``), in a coroutine of ours."""
    return _sent_async(wrapped, instance, args, kwargs, [])


def _sent_async(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any], gathering: _Gathering | None
) -> Any:
    request = _request_of(args, kwargs)
    if request is not None:
        sent = _at_transport(instance, request, gathering)
        if gathering:
            return _gathered(gathering[0], lambda: _sent_async(wrapped, instance, args, kwargs, None))
        args, kwargs = _with_request(args, kwargs, sent)
        if sent is not request:
            return _answer_of(wrapped(*args, **kwargs), sent)
    return wrapped(*args, **kwargs)


async def _gathered(
    waiting: tuple[_hop.Offered, _gathering.Body, _hop.Destination], send: Callable[[], Awaitable[Any]]
) -> Any:
    """Wait for the step to gather, then plan and send the request as any other (``send``: the same
    hook again, told not to gather)."""
    await _gathering.gather(*waiting)
    return await send()


def _answered(response: Any, sent: Any) -> None:
    """The answer to a hop that carried something of ours goes to ``_evidence``, which decides which
    statuses are error answers (429, 5xx)."""
    try:
        _evidence.answered_status(response.status_code, *_destination(sent.url))
    except Exception as exc:  # evidence lost, never the response
        _faults.report("reading a response's status", exc)


async def _answer_of(sending: Any, sent: Any) -> Any:
    """Await ``sending`` (the original's coroutine) and look at its answer's status."""
    response = await sending
    _answered(response, sent)
    return response


def _handle_elsewhere(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    request = _request_of(args, kwargs)
    begun = _begin_elsewhere(request) if request is not None else None
    if begun is None:
        return wrapped(*args, **kwargs)
    sent, entry = begun
    sent_args, sent_kwargs = _with_request(args, kwargs, sent)
    _in_flight[id(sent)] = entry
    try:
        return wrapped(*sent_args, **sent_kwargs)
    finally:
        _in_flight.pop(id(sent), None)


def _handle_elsewhere_async(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """The original called at once with our copy; the copy is in flight while its coroutine runs. A
    first step's first request of an attempt waits for its step first (``_gathering``), in a
    coroutine of ours (the openai SDK's aiohttp backend is such a transport)."""
    return _elsewhere_async(wrapped, args, kwargs, [])


def _elsewhere_async(
    wrapped: Any, args: tuple[Any, ...], kwargs: dict[str, Any], gathering: _Gathering | None
) -> Any:
    request = _request_of(args, kwargs)
    begun = _begin_elsewhere(request, gathering) if request is not None else None
    if gathering:
        return _gathered(gathering[0], lambda: _elsewhere_async(wrapped, args, kwargs, None))
    if begun is None:
        return wrapped(*args, **kwargs)
    sent, entry = begun
    sent_args, sent_kwargs = _with_request(args, kwargs, sent)
    return _in_flight_while(wrapped(*sent_args, **sent_kwargs), entry)


async def _in_flight_while(sending: Any, entry: tuple[Any, _hop.Destination, Any]) -> Any:
    """Await ``sending`` with ``entry`` registered in flight: from its start, so a coroutine never
    awaited leaves nothing behind."""
    key = id(entry[0])
    _in_flight[key] = entry
    try:
        return await sending
    finally:
        _in_flight.pop(key, None)


class HTTPXSessionInstrumentor(SessionInstrumentor):
    """Session headers for httpx's ``Client`` and ``AsyncClient`` (entry point ``otel_session_httpx``)."""

    library = "httpx"
    requirement = "httpx >= 0.23"
    replaces = ("httpx",)
    upstream = ("opentelemetry.instrumentation.httpx", "HTTPXClientInstrumentor")

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
    replaces = ("httpx2",)
    upstream = ("opentelemetry.instrumentation.httpx", "HTTPX2ClientInstrumentor")
