"""The router process: wires fleet, ingest, index, policy and proxy into one aiohttp app.

``Router`` owns the state and the decision (``decide``); the HTTP handlers live in
``proxy`` (client traffic) and ``ops`` (metrics, health, debug). ``serve`` runs it until a
signal; tests use ``Router.start()`` / ``stop()`` with an ``aiohttp.web.AppRunner``.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import aiohttp
from aiohttp import web

from events.hashing import HashScheme, LoRA
from router.config import RouterConfig
from router.discovery import DnsDiscovery, parse_target
from router.errors import RouterError, error_response
from router.fleet import Fleet, HealthChecker, InstanceState
from router.index import Match, MemoryIndex
from router.ingest import EventApplier, Ingest
from router.instance import InstanceKey
from router.keys import KeyTranslator
from router.metrics import RouterMetrics
from router.parity import ADOPTED, MISMATCH, TOKEN_KEYS, UNTRUSTED, ParityTracker, scan_seeds
from router.pending import PendingEntries
from router.policy import Candidate, NoHealthyInstance, Policy
from router.prompt import (
    PromptHasher,
    PromptTokenizer,
    PromptUnsupported,
    RequestError,
    decode_prompt_embeds,
    uses_prefix_cache,
    validate_cache_salt,
)
from router.proxy import RouteDecision
from router.redis_load import Load
from router.shared import Hooks, ParityRecord, SharedRuntime, adopt_parity
from router.tasks import cancel_and_wait

log = logging.getLogger("router.server")

ENGINE_TOKENIZER = "engine"


class Router:
    """One router process's state; ``app`` serves it."""

    def __init__(self, config: RouterConfig, hf_tokenizer: Any = None) -> None:
        self.config = config
        self.metrics = RouterMetrics()
        self.fleet = Fleet()
        # With --index redis:// this is the mirror of the instances this replica ingests;
        # matches then come from Redis through ``self.shared``.
        self.index = MemoryIndex()
        self.shared: SharedRuntime | None = None
        if config.index != "memory":
            self.shared = SharedRuntime(
                config.index,
                Hooks(
                    wanted=self._ingest_wanted,
                    start_ingest=self._start_ingest,
                    stop_ingest=self._stop_ingest,
                    export_parity=self._export_parity,
                    import_parity=self._import_parity,
                ),
                self.index,
                pending_ttl_s=config.pending_ttl_s,
            )
        self.pending = PendingEntries(config.pending_ttl_s)
        self.policy = Policy(
            load_weight=config.load_weight,
            temperature=config.temperature,
            max_share=config.max_share,
            in_flight_tokens=config.in_flight_tokens,
        )
        self.default_scheme = HashScheme(
            algo=config.hash_algo, seed=_first_seed(config), block_size=config.block_size
        )
        lora_paths = {lo.name: lo.path for lo in (config.lora_adapters or {}).values()}
        self.parity = ParityTracker(
            self.default_scheme,
            [s for s in (config.hash_seeds or []) if s is not None],
            config.hash_scheme,
            lora_paths=lora_paths,
        )
        self._lora_paths = lora_paths
        self._translators: dict[InstanceKey, KeyTranslator] = {}
        self._scans: set[InstanceKey] = set()
        self._background: set[asyncio.Task] = set()
        self.hasher = PromptHasher()
        self.tokenizer: PromptTokenizer | None = None
        if config.tokenizer != ENGINE_TOKENIZER:
            if hf_tokenizer is None:
                from events.tokenizer import load_tokenizer

                hf_tokenizer = load_tokenizer(config.tokenizer or None)
            self.tokenizer = PromptTokenizer(hf_tokenizer)
        self.applier = EventApplier(
            self.index,
            self.pending,
            self.fleet,
            self.metrics,
            observe=self._observe,
            translate=self._translate,
            on_drop=self._dropped,
            remote=self.shared,
        )
        self.ingest = Ingest(self.applier)
        self.session: aiohttp.ClientSession = None  # type: ignore[assignment]
        self.health: HealthChecker | None = None
        self.discovery: DnsDiscovery | None = None
        self.fleet.on_added(self._instance_added)
        self.fleet.on_removed(self._instance_removed)
        self.fleet.on_health_change(self._health_changed)
        if self.shared is not None:
            self.fleet.on_load(self.shared.load.change)
        self.metrics.on_scrape(self._refresh_gauges)
        self._started = False
        self._expire_task: asyncio.Task | None = None

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        cfg = self.config
        connector = aiohttp.TCPConnector(
            limit=0, limit_per_host=0, ttl_dns_cache=60, enable_cleanup_closed=True
        )
        timeout = aiohttp.ClientTimeout(
            total=None, connect=cfg.connect_timeout_s, sock_read=cfg.request_timeout_s
        )
        # No cookie jar: a jar would store an engine's Set-Cookie and attach it to every
        # other client's requests (and filter cookies per request for nothing); clients'
        # own Cookie headers still pass through with their other headers.
        self.session = aiohttp.ClientSession(
            connector=connector,
            timeout=timeout,
            auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        self._started = True
        for spec in cfg.engines or []:
            self.fleet.add_engine(spec)
        if cfg.discovery:
            self.discovery = DnsDiscovery(
                self.fleet, parse_target(cfg.discovery), cfg.discovery_interval_s
            )
            await self.discovery.resolve_once()
            self.discovery.start()
        self.health = HealthChecker(
            self.fleet,
            self.session,
            cfg.health_interval_s,
            timeout_s=min(2.0, cfg.connect_timeout_s + 1),
        )
        self.health.start()
        self._expire_task = asyncio.create_task(self._expire_loop(), name="pending-expiry")
        if self.shared is not None:
            await self.shared.start()

    async def stop(self) -> None:
        await cancel_and_wait(self._expire_task)
        if self.discovery is not None:
            await self.discovery.stop()
        if self.health is not None:
            await self.health.stop()
        if self.shared is not None:
            await self.shared.stop()  # stops ingest first, then hands the leases over
        await self.ingest.close()
        if self.session is not None:
            await self.session.close()

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(max(0.05, min(1.0, self.config.pending_ttl_s / 2 or 1.0)))
            self.pending.expire(time.monotonic())

    def poke_health(self) -> None:
        if self.health is not None:
            self.health.poke()

    # -- fleet callbacks ----------------------------------------------------------------

    def _instance_added(self, st: InstanceState) -> None:
        seed = getattr(st.spec, "hash_seed", None)
        if seed is not None:
            self.parity.set_configured(st.key, replace(self.default_scheme, seed=str(seed)))
        if self._started and self.shared is None:
            self.ingest.start(st)  # shared index: the lease loop starts it, if ours

    def _instance_removed(self, st: InstanceState) -> None:
        self.ingest.stop_soon(st.key)
        self.parity.forget(st.key)
        self._translators.pop(st.key, None)
        self.index.forget_instance(st.key)
        self.pending.drop_instance(st.key)
        self.metrics.forget_instance(str(st.key))
        if self.shared is not None:
            self.shared.forget_instance(st.key)

    def _health_changed(self, st: InstanceState) -> None:
        self.metrics.healthy.labels(str(st.key)).set(1.0 if st.healthy else 0.0)
        if st.healthy and self._started:
            # vLLM 0.33's stream has no epoch: an engine that was unreachable may have
            # restarted with seqs that look like a continuation. Rebuild its blocks from its
            # replay buffer instead of trusting what we had.
            if self.shared is not None:
                self.shared.rebuild_soon(st.key)  # only the lease holder rebuilds
                return
            self.applier.drop(st.key, "engine was unreachable; rebuilding its blocks from replay")
            self.ingest.restart(st)

    def _observe(self, key: InstanceKey, ev: Any) -> None:
        """Parity check of one block-0 event; a seed scan runs in a thread when needed."""
        v = self.parity.observe(key, ev)
        if v is None:
            return
        if v.changed:
            self._parity_changed(key, v.state, v.message)
        if v.needs_scan and key not in self._scans:
            ev0 = self.parity.scan_event(key) or ev
            self._scans.add(key)
            task = asyncio.get_running_loop().create_task(
                self._scan(key, ev0), name=f"seed-scan {key}"
            )
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _scan(self, key: InstanceKey, ev: Any) -> None:
        try:
            found = await asyncio.to_thread(scan_seeds, ev)
            if self.fleet.get(key) is None:
                return
            v = self.parity.apply_scan(key, found)
            self._parity_changed(key, v.state, v.message)
        finally:
            self._scans.discard(key)

    def _parity_changed(self, key: InstanceKey, state: str, message: str) -> None:
        label = str(key)
        self.metrics.set_parity(label, state)
        if state == TOKEN_KEYS:
            # The engine's own hashes are useless to the prompt side from now on.
            self.index.drop_instance(key)
            if self.shared is not None:
                self.shared.drop_soon(key)
            self.pending.drop_instance(key)
            self._translators[key] = KeyTranslator(self.parity.key_algo, self._lora_paths)
            log.error("HASH PARITY FAILED instance=%s state=%s: %s", key, state, message)
        elif state in (MISMATCH, UNTRUSTED):
            log.error("hash parity problem instance=%s state=%s: %s", key, state, message)
        elif state == ADOPTED:
            log.warning("hash scheme adopted instance=%s: %s", key, message)
        else:
            log.info("hash parity instance=%s state=%s", key, state)

    def _translate(self, key: InstanceKey, batch: Any) -> Any:
        tr = self._translators.get(key)
        return None if tr is None else tr.translate_batch(batch)

    def _dropped(self, key: InstanceKey, reason: str) -> None:
        """A restart or an unfillable gap: the engine may come back with another scheme."""
        self._translators.pop(key, None)
        self.parity.reset(key)

    # -- shared state (--index redis://) ------------------------------------------------

    def _ingest_wanted(self) -> list[InstanceKey]:
        return [st.key for st in self.fleet.instances() if st.spec.events_endpoint(st.key.rank)]

    def _start_ingest(self, key: InstanceKey, from_seq: int) -> None:
        st = self.fleet.get(key)
        if st is not None:
            self.ingest.start(st, from_seq=from_seq)

    async def _stop_ingest(self, key: InstanceKey) -> None:
        await self.ingest.stop(key)

    def _export_parity(self, key: InstanceKey) -> ParityRecord | None:
        st = self.fleet.get(key)
        if st is None:
            return None
        return ParityRecord(
            self.parity.state(key), self.scheme_of(key), st.stale, self.parity.message(key)
        )

    def _import_parity(self, key: InstanceKey, rec: ParityRecord) -> None:
        """The ingesting replica's verdict: hash prompts for this instance as it does."""
        st = self.fleet.get(key)
        if st is None:
            return
        st.stale = rec.stale
        if not adopt_parity(self.parity, key, rec):
            return
        if rec.state == TOKEN_KEYS:
            self._translators.setdefault(key, KeyTranslator(self.parity.key_algo, self._lora_paths))
        else:
            self._translators.pop(key, None)
        self.metrics.set_parity(str(key), rec.state)
        log.info(
            "hash parity from the ingesting replica instance=%s state=%s scheme=%s",
            key,
            rec.state,
            rec.scheme.describe(),
        )

    # -- the decision -------------------------------------------------------------------

    def scheme_of(self, key: InstanceKey) -> HashScheme:
        return self.parity.scheme(key)

    def trusted(self, key: InstanceKey) -> bool:
        return self.parity.trusted(key)

    async def tokenize(self, body: dict, kind: str) -> list[int]:
        if self.tokenizer is not None:
            try:
                if kind == "chat":
                    return self.tokenizer.chat_tokens(body)
                return self.tokenizer.completion_tokens(body)
            except PromptUnsupported:
                pass  # fall back to the engine's own tokenizer
        return await self._engine_tokenize(body, kind)

    async def _engine_tokenize(self, body: dict, kind: str) -> list[int]:
        urls = self.fleet.healthy_engine_urls()
        if not urls:
            raise RouterError(503, "no healthy engine to tokenize with")
        if kind == "chat":
            keys = (
                "model",
                "messages",
                "add_generation_prompt",
                "continue_final_message",
                "add_special_tokens",
                "chat_template",
                "chat_template_kwargs",
                "tools",
            )
        else:
            keys = ("model", "prompt", "add_special_tokens")
        req = {k: body[k] for k in keys if k in body}
        if kind != "chat" and not isinstance(req.get("prompt"), str):
            if self.tokenizer is None and isinstance(body.get("prompt"), list):
                p = body["prompt"]
                return list(p[0] if p and isinstance(p[0], list) else p)
            return []
        try:
            async with self.session.post(urls[0] + "/tokenize", json=req) as r:
                obj = await r.json(content_type=None)
                if r.status >= 400:
                    err = (obj or {}).get("error") or {}
                    if r.status < 500:
                        raise RouterError(
                            r.status,
                            err.get("message") or "engine refused /tokenize",
                            err.get("param"),
                        )
                    raise RouterError(502, f"engine /tokenize failed with {r.status}")
                return list(obj.get("tokens") or [])
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError) as e:
            self.poke_health()
            raise RouterError(502, f"engine /tokenize failed: {type(e).__name__}") from None

    async def decide(
        self, body: dict, kind: str, exclude: set[InstanceKey] | None = None
    ) -> RouteDecision:
        """Tokenize, hash with each instance's scheme, match, choose (timed per stage)."""
        m = self.metrics
        t0 = time.perf_counter()
        try:
            salt = validate_cache_salt(body.get("cache_salt"))
            embeds = None
            if kind == "completions" and body.get("prompt_embeds") is not None:
                embeds = decode_prompt_embeds(body["prompt_embeds"])
            tokens = await self.tokenize(body, kind)
            credit = uses_prefix_cache(body, chat=kind == "chat")
        except RequestError as e:
            raise RouterError(e.code, e.message, e.param) from None
        t1 = time.perf_counter()
        lora = self._lora_of(body.get("model"))
        routable = [st for st in self.fleet.routable() if not exclude or st.key not in exclude]
        if not routable:
            raise RouterError(503, "no healthy engine instance to route to")
        groups: dict[HashScheme, list[InstanceState]] = {}
        for st in routable:
            groups.setdefault(self.scheme_of(st.key), []).append(st)
        hashes_by_scheme: dict[HashScheme, list[int]] = {}
        for scheme in groups:
            if embeds is not None:
                hashes_by_scheme[scheme] = self.hasher.embeds_hashes(embeds, scheme, salt, lora)
            else:
                hashes_by_scheme[scheme] = self.hasher.hashes(tokens, scheme, salt, lora)
        t2 = time.perf_counter()
        now = time.monotonic()
        bs = self.config.block_size
        candidates: list[Candidate] = []
        hashes: dict[InstanceKey, list[int]] = {}
        loads: dict[InstanceKey, Load] | None = None
        found: list[dict[InstanceKey, Match]]
        if self.shared is None:
            found = [
                self.index.match(hashes_by_scheme[sc], among=[st.key for st in members])
                if hashes_by_scheme[sc]
                else {}
                for sc, members in groups.items()
            ]
        else:
            # Shared index and load: one Redis round trip each, all at once; never raises
            # (a degraded replica answers from its mirror and its own counts).
            *found, loads = await asyncio.gather(
                *(
                    self.shared.match(hashes_by_scheme[sc], [st.key for st in members])
                    for sc, members in groups.items()
                ),
                self.shared.load_view(),
            )
        for (scheme, members), matches in zip(groups.items(), found, strict=True):
            hs = hashes_by_scheme[scheme]
            pend = self.pending.match(hs, now) if hs else {}
            ratio = scheme.block_size / bs
            for st in members:
                mt = matches.get(st.key)
                blocks = mt.blocks if mt else 0
                tier = mt.best_tier_blocks if mt else 0
                p = pend.get(st.key, 0)
                if ratio != 1:
                    blocks, tier, p = (int(x * ratio) for x in (blocks, tier, p))
                hashes[st.key] = hs
                if loads is None:
                    in_flight, queued = st.in_flight, st.queued_tokens
                else:
                    ld = loads.get(st.key)
                    in_flight, queued = (ld.in_flight, ld.queued_tokens) if ld else (0, 0)
                candidates.append(
                    Candidate(
                        st.key,
                        blocks,
                        pending_blocks=p,
                        tier_blocks=max(tier, blocks),
                        in_flight=in_flight,
                        queued_tokens=queued,
                        healthy=True,
                        trusted=self.trusted(st.key),
                    )
                )
        t3 = time.perf_counter()
        n_tokens = int(embeds.shape[0]) if embeds is not None else len(tokens)
        try:
            d = self.policy.choose(n_tokens, bs, candidates, prefix_credit=credit)
        except NoHealthyInstance as e:
            raise RouterError(503, str(e)) from None
        t4 = time.perf_counter()
        timings = {
            "tokenize": t1 - t0,
            "hash": t2 - t1,
            "match": t3 - t2,
            "choose": t4 - t3,
            "total": t4 - t0,
        }
        for stage, v in timings.items():
            m.observe_stage(stage, v)
        return RouteDecision(
            chosen=d.chosen,
            predicted_hit_tokens=d.predicted_hit_tokens,
            prompt_tokens=n_tokens,
            block_size=bs,
            prefix_credit=credit,
            candidates=candidates,
            decision=d,
            hashes=hashes,
            timings=timings,
            scheme={st.key: sc for sc, members in groups.items() for st in members},
        )

    def _lora_of(self, model: Any) -> LoRA | None:
        adapters = self.config.lora_adapters or {}
        if not isinstance(model, str) or model not in adapters:
            return None
        v = adapters[model]
        if isinstance(v, LoRA):
            return v
        if isinstance(v, str):
            return LoRA(model, v)
        if isinstance(v, (tuple, list)) and len(v) == 2:
            return LoRA(str(v[0]), str(v[1]))
        return None

    def record_pending(self, d: RouteDecision) -> None:
        hs = d.hashes.get(d.chosen)
        if hs and d.prefix_credit:
            self.pending.add(d.chosen, hs, time.monotonic())
            if self.shared is not None:
                self.shared.add_pending_soon(d.chosen, hs)

    def check_prediction(self, key: InstanceKey, d: RouteDecision, usage: dict | None) -> None:
        from router.proxy import cached_tokens_of

        series = self.metrics.instance(str(key))
        series.predicted.inc(d.predicted_hit_tokens)
        actual = cached_tokens_of(usage)
        if actual is None:
            return
        series.actual.inc(actual)
        pt = usage.get("prompt_tokens") if usage else None
        if isinstance(pt, int):
            series.prompt_tokens.inc(pt)
        series.error.observe(d.predicted_hit_tokens - actual)

    # -- introspection ------------------------------------------------------------------

    def explain(self, d: RouteDecision) -> dict[str, Any]:
        st = self.fleet.get(d.chosen)
        insts = []
        scores = {s["instance"]: s for s in d.decision.scores}
        for c in d.candidates:
            s = dict(scores.get(str(c.inst), {}))
            ist = self.fleet.get(c.inst)
            s.update(
                {
                    "url": ist.url if ist else c.inst.engine,
                    "rank": c.inst.rank,
                    "stale": bool(ist and ist.stale),
                    "parity": self.parity.state(c.inst),
                    "scheme": _describe(d.scheme.get(c.inst)),
                }
            )
            insts.append(s)
        insts.sort(key=lambda s: s.get("cost", 0))
        return {
            "chosen": str(d.chosen),
            "url": st.url if st else d.chosen.engine,
            "rank": d.chosen.rank,
            "predicted_hit_tokens": d.predicted_hit_tokens,
            "prompt_tokens": d.prompt_tokens,
            "block_size": d.block_size,
            "prefix_credit": d.prefix_credit,
            "cost_formula": "uncached_prefill_tokens + load_weight * load_tokens",
            "load_weight": self.config.load_weight,
            "timings_us": {k: round(v * 1e6, 1) for k, v in d.timings.items()},
            "instances": insts,
        }

    def fleet_summary(self) -> list[dict[str, Any]]:
        out = []
        for st in self.fleet.instances():
            d = st.describe()
            s = self.applier.stats.get(st.key)
            d["events"] = vars(s) if s else None
            d["parity"] = self.parity.state(st.key)
            d["scheme"] = self.scheme_of(st.key).describe()
            d["blocks"] = self.index.instance_blocks(st.key)
            out.append(d)
        return out

    def index_summary(self) -> dict[str, Any]:
        out = {
            "index": self.index.stats(),
            "pending_entries": self.pending.count(),
            "instances": self.fleet_summary(),
        }
        if self.shared is not None:
            out["shared"] = self.shared.summary()  # "index" is then this replica's mirror
        return out

    def _refresh_gauges(self) -> None:
        m = self.metrics
        stats = self.index.stats()
        m.index_entries.set(stats.get("entries", 0))
        m.index_bytes.set(stats.get("approx_bytes", 0))
        m.pending_entries.set(self.pending.count())
        for st in self.fleet.instances():
            label = str(st.key)
            m.healthy.labels(label).set(1.0 if st.healthy else 0.0)
            m.stale.labels(label).set(1.0 if st.stale else 0.0)
            m.in_flight.labels(label).set(st.in_flight)
            m.queued_tokens.labels(label).set(st.queued_tokens)
            m.index_blocks.labels(label).set(sum(self.index.instance_blocks(st.key).values()))
            m.set_parity(label, self.parity.state(st.key))
        if self.shared is not None:
            sh = self.shared
            held = {str(st.key): sh.holds(st.key) for st in self.fleet.instances()}
            m.set_shared(sh.state.metrics(), held, sh.lease_changes)


def _describe(scheme: HashScheme | str | None) -> str | None:
    """A decision keeps its schemes as objects; they are described only when explained."""
    return scheme.describe() if isinstance(scheme, HashScheme) else scheme


def _first_seed(config: RouterConfig) -> str | None:
    return getattr(config, "hash_seed", None)


# -- app ----------------------------------------------------------------------------------


@web.middleware
async def error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """Unknown routes and wrong methods in OpenAI's error shape; a bug becomes a logged 500."""
    try:
        return await handler(request)
    except RouterError as e:
        return error_response(e.status, e.message, e.param)
    except web.HTTPNotFound:
        return error_response(404, f"route {request.method} {request.path} not found")
    except web.HTTPMethodNotAllowed:
        return error_response(405, f"method {request.method} not allowed on {request.path}")
    except web.HTTPRequestEntityTooLarge as e:
        return error_response(413, e.text or "request body too large")
    except web.HTTPException:
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(500, "internal router error")


def build_app(router: Router) -> web.Application:
    from router import ops, proxy

    app = web.Application(
        middlewares=[error_middleware], client_max_size=router.config.max_body_bytes + 1024
    )
    app[ops.ROUTER_KEY] = router
    proxy.add_routes(app)
    ops.add_routes(app)

    async def on_startup(app: web.Application) -> None:
        await router.start()

    async def on_cleanup(app: web.Application) -> None:
        await router.stop()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


async def run_router(
    config: RouterConfig, hf_tokenizer: Any = None, ready: asyncio.Event | None = None
) -> None:
    """Serve until SIGINT/SIGTERM (or cancellation)."""
    router = Router(config, hf_tokenizer)
    app = build_app(router)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port, backlog=1024, reuse_address=True)
    await site.start()
    log.info(
        "router listening host=%s port=%d instances=%d",
        config.host,
        config.port,
        len(router.fleet.instances()),
    )
    # Everything alive now (tokenizer, transformers, torch: ~350k objects) lives as long as
    # the process. Frozen, the cyclic GC stops re-scanning it: an oldest-generation
    # collection otherwise takes ~0.1 s, a stall on every request in flight at the time.
    gc.collect()
    gc.freeze()
    print(f"prefix-router ready on http://{config.host}:{config.port}", flush=True)
    if ready is not None:
        ready.set()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def install_uvloop() -> bool:
    try:
        import uvloop
    except ImportError:
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True


def serve(config: RouterConfig, argv: Sequence[str] | None = None) -> int:
    install_uvloop()
    try:
        asyncio.run(run_router(config))
    except KeyboardInterrupt:
        pass
    return 0
