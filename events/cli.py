"""``kv-events``: look at a vLLM KV-event stream, recompute block hashes, publish a demo stream.

Operators reach for it when the router's view of an engine looks wrong: ``tail`` shows what
the engine really publishes (with gaps, replays and restarts spelled out), ``hash`` shows
what the engine should have called a prompt's blocks, ``replay`` shows what the engine still
has buffered, and ``demo-publish`` gives a newcomer a realistic stream to try the rest on.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

from events.codec import CodecError, batch_to_dict, decode_batch
from events.endpoints import EndpointError, check_endpoint_syntax, probe_tcp
from events.hashing import ALGORITHMS, HashingError, HashScheme, LoRA
from events.model import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from events.subscriber import EventSubscriber, ReplayError, StreamItem, SubscriberStats

EXIT_USAGE = 2


class CliError(Exception):
    """A problem the user can fix; printed as one line, exit code 2."""


# --------------------------------------------------------------------------------------
# Formatting (pure)


def format_event(ev: Any) -> str:
    if isinstance(ev, BlockStored):
        first = ev.block_hashes[0] if ev.block_hashes else "-"
        return (
            f"BlockStored(blocks={len(ev.block_hashes)} first={first} "
            f"tokens={len(ev.token_ids)} medium={ev.medium})"
        )
    if isinstance(ev, BlockRemoved):
        first = ev.block_hashes[0] if ev.block_hashes else "-"
        return f"BlockRemoved(blocks={len(ev.block_hashes)} first={first} medium={ev.medium})"
    if isinstance(ev, AllBlocksCleared):
        return "AllBlocksCleared"
    return type(ev).__name__


def format_item(item: StreamItem) -> str:
    """One human-readable line per stream item."""
    if item.kind == "batch":
        assert item.batch is not None
        tag = " replayed" if item.replayed else ""
        evs = " ".join(format_event(e) for e in item.batch.events) or "(no events)"
        return f"seq={item.seq} dp={item.batch.data_parallel_rank}{tag} {evs}"
    if item.kind == "gap":
        lo, hi = item.missing or (None, None)
        rng = f"{lo}" if lo == hi else f"{lo}-{hi}"
        return f"GAP seq={rng} not recovered: {item.detail}"
    if item.kind == "restart":
        return f"RESTART {item.detail}"
    seq = "?" if item.seq is None else item.seq
    return f"BAD FRAME seq={seq}{' replayed' if item.replayed else ''}: {item.detail}"


def item_to_json(item: StreamItem) -> dict[str, Any]:
    d: dict[str, Any] = {"kind": item.kind, "seq": item.seq, "replayed": item.replayed}
    if item.batch is not None:
        d.update(batch_to_dict(item.batch))
    if item.missing is not None:
        d["missing"] = list(item.missing)
    if item.detail:
        d["detail"] = item.detail
    return d


class Rates:
    """Counts for --stats: batches and blocks stored/removed since the last report."""

    def __init__(self) -> None:
        self.batches = self.stored = self.removed = 0
        self.since = time.monotonic()

    def add(self, batch: KVEventBatch) -> None:
        self.batches += 1
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self.stored += len(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                self.removed += len(ev.block_hashes)

    def report(self, stats: SubscriberStats) -> str:
        now = time.monotonic()
        dt = max(now - self.since, 1e-9)
        line = (
            f"stats: {self.batches / dt:.1f} batches/s, {self.stored / dt:.1f} blocks stored/s, "
            f"{self.removed / dt:.1f} blocks removed/s | {_totals(stats)}"
        )
        self.batches = self.stored = self.removed = 0
        self.since = now
        return line


def _totals(s: SubscriberStats) -> str:
    return (
        f"batches={s.batches} replayed={s.replayed} gaps={s.gaps} (filled={s.gaps_filled} "
        f"unfilled={s.gaps_unfilled}) restarts={s.restarts} bad_frames={s.bad_frames} "
        f"last_seq={s.last_seq}"
    )


# --------------------------------------------------------------------------------------
# tail


def cmd_tail(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    for ep in (args.endpoint, args.replay):
        if ep is not None:
            check_endpoint_syntax(ep)
    if not args.bind:
        probe_tcp(args.endpoint)
    if args.replay is not None:
        probe_tcp(args.replay)
    sub = EventSubscriber(
        args.endpoint,
        replay_endpoint=args.replay,
        topic=args.topic,
        bind=args.bind,
        from_seq=args.from_seq,
        replay_timeout_s=args.replay_timeout,
    )
    # Restore Python's Ctrl-C if a parent shell started us with SIGINT ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    rates = Rates()
    start = time.monotonic()
    stop_at = None if args.timeout is None else start + args.timeout
    next_stats = start + args.stats_interval
    seen = 0
    reason = "interrupted"
    try:
        while True:
            now = time.monotonic()
            if args.count is not None and seen >= args.count:
                reason = f"{args.count} batches received"
                break
            if stop_at is not None and now >= stop_at:
                reason = f"--timeout {args.timeout:g}s reached"
                break
            wait = 0.25
            if stop_at is not None:
                wait = min(wait, stop_at - now)
            if args.stats:
                wait = min(wait, max(0.0, next_stats - now))
            item = sub.recv(timeout_s=max(0.0, wait))
            if item is not None:
                if item.kind == "batch":
                    seen += 1
                    assert item.batch is not None
                    rates.add(item.batch)
                if not args.quiet:
                    if args.json:
                        out.write(json.dumps(item_to_json(item)) + "\n")
                    else:
                        out.write(format_item(item) + "\n")
                    out.flush()
            if args.stats and time.monotonic() >= next_stats:
                err.write(rates.report(sub.stats) + "\n")
                err.flush()
                next_stats = time.monotonic() + args.stats_interval
    except KeyboardInterrupt:
        reason = "interrupted"
    finally:
        elapsed = time.monotonic() - start
        sub.close()
    err.write(f"summary ({reason}, {elapsed:.1f}s): {_totals(sub.stats)}\n")
    err.flush()
    return 0


# --------------------------------------------------------------------------------------
# hash


def _parse_tokens(text: str) -> list[int]:
    try:
        toks = json.loads(text)
    except json.JSONDecodeError as e:
        raise CliError(
            f"token ids are not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
        ) from None
    if not isinstance(toks, list) or not all(type(t) is int and t >= 0 for t in toks):
        raise CliError("token ids must be a JSON list of non-negative integers, e.g. [1, 2, 3]")
    return toks


def cmd_hash(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    text = args.tokens if args.tokens is not None else sys.stdin.read()
    toks = _parse_tokens(text)
    lora = None
    if args.lora is not None:
        name, sep, path = args.lora.partition(":")
        if not name:
            raise CliError(f"--lora expects NAME:PATH (or NAME), got {args.lora!r}")
        lora = LoRA(name=name, path=path if sep else "")
    try:
        scheme = HashScheme(
            algo=args.algo,
            seed=args.seed,
            block_size=args.block_size,
            extra_key_style=args.extra_keys,
        )
        digests = scheme.block_digests(toks, cache_salt=args.cache_salt, lora=lora)
    except HashingError as e:
        raise CliError(str(e)) from None
    for d in digests:
        out.write((d.hex() if args.hex else str(int.from_bytes(d[-8:], "big"))) + "\n")
    if not digests:
        err.write(f"no full block: {len(toks)} tokens, block size {args.block_size}\n")
    return 0


# --------------------------------------------------------------------------------------
# replay


def cmd_replay(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    probe_tcp(args.endpoint)
    # The SUB side is never read; bind it to an ephemeral inproc name just to reuse the client.
    sub = EventSubscriber(
        f"inproc://kv-events-replay-{id(args)}",
        replay_endpoint=args.endpoint,
        bind=True,
        replay_timeout_s=args.timeout,
    )
    try:
        msgs = sub.replay(args.from_seq)
    except ReplayError as e:
        raise CliError(str(e)) from None
    finally:
        sub.close()
    for seq, payload in msgs:
        try:
            batch = decode_batch(payload)
        except CodecError as e:
            item = StreamItem("bad_frame", seq=seq, replayed=True, detail=str(e))
        else:
            item = StreamItem("batch", seq=seq, batch=batch, replayed=True)
        out.write((json.dumps(item_to_json(item)) if args.json else format_item(item)) + "\n")
    first = msgs[0][0] if msgs else None
    last = msgs[-1][0] if msgs else None
    err.write(
        f"end of replay: {len(msgs)} batches (seq {first}..{last}) from seq {args.from_seq}\n"
    )
    return 0


# --------------------------------------------------------------------------------------
# demo-publish


class DemoStream:
    """Synthetic but plausible engine steps: prompts that share prefixes, LRU evictions.

    Hashes are real sha256_cbor chains of the synthetic tokens, so ``kv-events hash`` on a
    prompt's tokens gives the hashes ``tail`` shows.
    """

    def __init__(self, seed: int, block_size: int = 16, capacity: int = 512) -> None:
        self.rng = random.Random(seed)
        self.scheme = HashScheme(block_size=block_size)
        self.block_size = block_size
        self.capacity = capacity
        # A few shared system prompts make parent chains and prefix reuse visible.
        self.prefixes = [
            [self.rng.randrange(100, 50_000) for _ in range(block_size * self.rng.randint(2, 6))]
            for _ in range(4)
        ]
        self.cached: dict[int, None] = {}  # insertion-ordered: oldest first (LRU)

    def step(self) -> KVEventBatch:
        """The next batch; like vLLM, a step that changed nothing publishes nothing."""
        while True:
            batch = self._step()
            if batch.events:
                return batch

    def _step(self) -> KVEventBatch:
        rng = self.rng
        events: list[Any] = []
        if rng.random() < 0.01:
            self.cached.clear()
            events.append(AllBlocksCleared())
            return KVEventBatch(ts=time.time(), events=events)
        toks = list(rng.choice(self.prefixes))
        toks += [rng.randrange(100, 50_000) for _ in range(rng.randint(8, 8 * self.block_size))]
        digests = self.scheme.block_digests(toks)
        hashes = [int.from_bytes(d[-8:], "big") for d in digests]
        # Like vLLM, only blocks not already cached are stored, chained to their parent.
        first_new = 0
        while first_new < len(hashes) and hashes[first_new] in self.cached:
            self.cached[hashes[first_new]] = self.cached.pop(hashes[first_new])  # touch
            first_new += 1
        new = hashes[first_new:]
        if new:
            bs = self.block_size
            events.append(
                BlockStored(
                    block_hashes=new,
                    parent_block_hash=hashes[first_new - 1] if first_new else None,
                    token_ids=toks[first_new * bs : len(hashes) * bs],
                    block_size=bs,
                    medium="GPU",
                    extra_keys=[None] * len(new),
                    group_idx=0,
                    kv_cache_spec_kind="full_attention",
                )
            )
            for h in new:
                self.cached[h] = None
        while len(self.cached) > self.capacity:
            old = next(iter(self.cached))
            del self.cached[old]
            events.append(BlockRemoved(block_hashes=[old], medium="GPU", group_idx=0))
        return KVEventBatch(ts=time.time(), events=events)


def cmd_demo_publish(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from events.publisher import ZmqEventPublisher

    for ep in (args.endpoint, args.replay):
        if ep is not None:
            check_endpoint_syntax(ep)
    try:
        pub = ZmqEventPublisher(
            endpoint=args.endpoint,
            replay_endpoint=args.replay,
            topic=args.topic,
            data_parallel_rank=args.dp_rank,
            buffer_steps=args.buffer_steps,
        )
    except Exception as e:  # zmq.ZMQError (address in use, bad address), ValueError
        raise CliError(
            f"cannot publish on {args.endpoint}: {getattr(e, 'strerror', None) or e}"
        ) from None
    if args.drop_every:
        k = args.drop_every
        pub.skip_send = lambda seq: seq % k == k - 1
    signal.signal(signal.SIGINT, signal.default_int_handler)
    demo = DemoStream(seed=args.seed, block_size=args.block_size)
    err.write(
        f"publishing on {pub.endpoint}"
        + (f", replay on {pub.replay_endpoint}" if pub.replay_endpoint else ", no replay")
        + f", {args.rate:g} batches/s"
        + (f", {args.count} batches" if args.count else "")
        + (f", live send of every {args.drop_every}th batch skipped" if args.drop_every else "")
        + "; Ctrl-C to stop\n"
    )
    err.flush()
    sent = 0
    period = 1.0 / args.rate if args.rate > 0 else 0.0
    next_at = time.monotonic()
    try:
        while not args.count or sent < args.count:
            if period:
                delay = next_at - time.monotonic()
                if delay > 0:
                    time.sleep(delay)  # pacing the demo stream, not waiting for an event
                next_at += period
            pub.publish(demo.step())
            sent += 1
        pub.flush(timeout=10.0)
        if args.linger > 0:
            # Keep the replay socket answering for late subscribers after the last batch.
            time.sleep(args.linger)
    except KeyboardInterrupt:
        pass
    finally:
        pub.close()
    err.write(f"published {sent} batches\n")
    return 0


# --------------------------------------------------------------------------------------
# argument parsing


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kv-events",
        description="Inspect vLLM KV-event streams (ZMQ), recompute prefix-cache block hashes, "
        "and publish a synthetic demo stream.",
    )
    sp = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    t = sp.add_parser(
        "tail",
        help="print a live KV-event stream, repairing gaps through replay",
        description="Subscribe to a vLLM KV-event publisher and print one line per batch "
        "(seq, DP rank, each event's type, block count, first hash, token count, medium). "
        "Gaps are filled through the replay endpoint when given; gaps that cannot be filled, "
        "publisher restarts and undecodable frames are printed as GAP, RESTART and BAD FRAME "
        "lines. Ctrl-C prints a summary (on stderr) and exits 0.",
    )
    t.add_argument(
        "endpoint", metavar="ENDPOINT", help="publisher endpoint, e.g. tcp://127.0.0.1:5557"
    )
    t.add_argument(
        "--replay", metavar="ENDPOINT", help="replay (ROUTER) endpoint, e.g. tcp://127.0.0.1:5558"
    )
    t.add_argument(
        "--from",
        dest="from_seq",
        type=int,
        metavar="SEQ",
        help="first replay everything buffered from SEQ on (needs --replay), then follow live",
    )
    t.add_argument("--topic", default="", help="topic prefix to subscribe to (default: all)")
    t.add_argument(
        "--bind",
        action="store_true",
        help="bind ENDPOINT instead of connecting (for engines configured with a remote endpoint, which connect)",
    )
    t.add_argument(
        "--json", action="store_true", help="print NDJSON, one object per item with every field"
    )
    t.add_argument(
        "--stats",
        action="store_true",
        help="every second, print rates (batches/s, blocks stored and removed per second) and "
        "gap/replay/restart counts on stderr",
    )
    t.add_argument("--stats-interval", type=float, default=1.0, metavar="S", help=argparse.SUPPRESS)
    t.add_argument(
        "-q", "--quiet", action="store_true", help="do not print batches (use with --stats)"
    )
    t.add_argument("--count", type=int, metavar="N", help="exit after N batches")
    t.add_argument("--timeout", type=float, metavar="S", help="exit after S seconds")
    t.add_argument(
        "--replay-timeout",
        type=float,
        default=2.0,
        metavar="S",
        help="how long to wait for the replay endpoint to answer (default: 2)",
    )
    t.set_defaults(func=cmd_tail)

    h = sp.add_parser(
        "hash",
        help="print the block hashes an engine would publish for token ids",
        description="Compute vLLM's prefix-cache block-hash chain for token ids (a JSON list, "
        "as the argument or on stdin) and print one event hash per full block as an unsigned "
        "decimal (the int vLLM puts in BlockStored.block_hashes), or the full digest in hex.",
    )
    h.add_argument(
        "tokens", nargs="?", metavar="TOKENS_JSON", help="e.g. '[1, 2, 3]' (default: read stdin)"
    )
    h.add_argument(
        "--algo",
        choices=ALGORITHMS,
        default="sha256_cbor",
        help="the engine's --prefix-caching-hash-algo (default: sha256_cbor)",
    )
    h.add_argument(
        "--seed",
        default=None,
        metavar="S",
        help="PYTHONHASHSEED of the engine process (default: unset, as vLLM >= 0.29 without it)",
    )
    h.add_argument(
        "--block-size", type=int, default=16, metavar="N", help="block size (default: 16)"
    )
    h.add_argument(
        "--cache-salt", default=None, metavar="S", help="the request's cache_salt (block 0 only)"
    )
    h.add_argument(
        "--lora",
        default=None,
        metavar="NAME:PATH",
        help="LoRA adapter name and path, hashed into every block",
    )
    h.add_argument(
        "--extra-keys",
        choices=("tagged", "untagged"),
        default="tagged",
        help="extra-key style: tagged (vLLM >= 0.31, default) or untagged (0.29)",
    )
    h.add_argument(
        "--hex", action="store_true", help="print full digests in hex instead of event ints"
    )
    h.set_defaults(func=cmd_hash)

    d = sp.add_parser(
        "demo-publish",
        help="publish a synthetic KV-event stream to try `tail` on",
        description="Publish a synthetic stream of realistic KV-event batches like a vLLM engine: "
        "stores with parent chains over shared prompt prefixes, LRU removals, an occasional "
        "AllBlocksCleared.",
    )
    d.add_argument(
        "--endpoint", default="tcp://*:5557", help="PUB endpoint (default: tcp://*:5557)"
    )
    d.add_argument(
        "--replay",
        default="tcp://*:5558",
        metavar="ENDPOINT",
        help="replay endpoint (default: tcp://*:5558)",
    )
    d.add_argument(
        "--no-replay", dest="replay", action="store_const", const=None, help="no replay socket"
    )
    d.add_argument(
        "--rate",
        type=float,
        default=10.0,
        metavar="N",
        help="batches per second (default: 10; 0 = as fast as possible)",
    )
    d.add_argument(
        "--count",
        type=int,
        default=0,
        metavar="N",
        help="stop after N batches (default: run until Ctrl-C)",
    )
    d.add_argument(
        "--block-size", type=int, default=16, metavar="N", help="block size (default: 16)"
    )
    d.add_argument(
        "--seed", type=int, default=0, help="random seed of the synthetic stream (default: 0)"
    )
    d.add_argument("--topic", default="", help="topic (default: empty)")
    d.add_argument(
        "--dp-rank",
        type=int,
        default=0,
        metavar="K",
        help="data-parallel rank: ports are offset by K as in vLLM",
    )
    d.add_argument(
        "--buffer-steps",
        type=int,
        default=10_000,
        metavar="N",
        help="batches kept for replay (default: 10000)",
    )
    d.add_argument(
        "--drop-every",
        type=int,
        default=0,
        metavar="K",
        help="skip the live send of every K-th batch (still replayable) to show gap repair",
    )
    d.add_argument(
        "--linger",
        type=float,
        default=0.0,
        metavar="S",
        help="after --count batches, keep answering replay requests for S seconds",
    )
    d.set_defaults(func=cmd_demo_publish)

    r = sp.add_parser(
        "replay",
        help="print what a replay endpoint returns",
        description="Send one replay request to a vLLM replay (ROUTER) endpoint and print every "
        "buffered batch from SEQ on, then a line on stderr with the count.",
    )
    r.add_argument(
        "endpoint", metavar="ENDPOINT", help="replay endpoint, e.g. tcp://127.0.0.1:5558"
    )
    r.add_argument(
        "--from", dest="from_seq", type=int, default=0, metavar="SEQ", help="first seq (default: 0)"
    )
    r.add_argument("--json", action="store_true", help="print NDJSON")
    r.add_argument(
        "--timeout",
        type=float,
        default=2.0,
        metavar="S",
        help="answer timeout in seconds (default: 2)",
    )
    r.set_defaults(func=cmd_replay)
    return p


def _validate(args: argparse.Namespace) -> None:
    if args.command == "tail":
        if args.from_seq is not None and args.from_seq < 0:
            raise CliError("--from must be >= 0")
        if args.from_seq is not None and args.replay is None:
            raise CliError(
                "--from needs --replay ENDPOINT (the catch-up comes from the replay socket)"
            )
        if args.count is not None and args.count <= 0:
            raise CliError("--count must be positive")
    if args.command == "replay" and args.from_seq < 0:
        raise CliError("--from must be >= 0")
    if args.command == "demo-publish":
        if args.block_size <= 0:
            raise CliError("--block-size must be positive")
        if args.buffer_steps <= 0:
            raise CliError("--buffer-steps must be positive")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        _validate(args)
        return args.func(args, sys.stdout, sys.stderr)
    except (CliError, EndpointError) as e:
        sys.stderr.write(f"kv-events {args.command}: {e}\n")
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
