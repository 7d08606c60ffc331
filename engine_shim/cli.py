"""``engine-shim``: a GPU-free vLLM 0.33 server, with vLLM's flag names where they exist.

    engine-shim --port 8001 \\
      --kv-events-config '{"enable_kv_cache_events":true,"endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5558"}' \\
      --num-gpu-blocks 2048 --block-size 16 --prefix-caching-hash-algo sha256_cbor \\
      --max-num-batched-tokens 2048 --max-num-seqs 128 --served-model-name NAME --seed 0 \\
      --time-scale 1.0 --data-parallel-size 1

PYTHONHASHSEED sets the NONE_HASH seed, as in vLLM. When the server is up it prints one
line, ``engine-shim ready on http://HOST:PORT events ...``, so scripts can wait for it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys

from engine_shim.backend import BACKENDS, BackendUnavailable
from engine_shim.engine import EngineConfig
from engine_shim.server import DEFAULT_MAX_BODY, KVEventsConfig, ShimConfig
from events.hashing import ALGORITHMS
from events.tokenizer import DEFAULT_MODEL_NAME, TokenizerUnavailable


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="engine-shim", description="A vLLM 0.33 engine emulator without a GPU."
    )
    ap.add_argument("model", nargs="?", default=None, help="accepted for vllm-serve parity; unused")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8001)
    ap.add_argument("--kv-events-config", default=None, help="vLLM's KVEventsConfig as JSON")
    ap.add_argument(
        "--num-gpu-blocks",
        "--num-gpu-blocks-override",
        dest="num_gpu_blocks",
        type=int,
        default=2048,
    )
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--prefix-caching-hash-algo", default="sha256", choices=ALGORITHMS)
    ap.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--served-model-name", default=DEFAULT_MODEL_NAME)
    ap.add_argument("--tokenizer", default=None, help="tokenizer directory (default: SmolLM2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="multiply simulated GPU time (1 = real time, 0 = no waiting)",
    )
    ap.add_argument("--data-parallel-size", "-dp", type=int, default=1)
    ap.add_argument("--backend", default="sim", choices=BACKENDS)
    ap.add_argument("--model-path", default=None, help="weights directory for --backend torch")
    ap.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY)
    return ap


def config_from_args(args: argparse.Namespace) -> ShimConfig:
    kv = KVEventsConfig.from_json(args.kv_events_config)
    engine = EngineConfig(
        num_gpu_blocks=args.num_gpu_blocks,
        block_size=args.block_size,
        hash_algo=args.prefix_caching_hash_algo,
        hash_seed=os.environ.get("PYTHONHASHSEED"),
        enable_prefix_caching=args.enable_prefix_caching,
        enable_kv_cache_events=kv.enable_kv_cache_events,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        seed=args.seed,
        time_scale=args.time_scale,
        backend=args.backend,
        model_path=args.model_path,
    )
    engine.validate()
    if args.data_parallel_size < 1:
        raise ValueError("--data-parallel-size must be at least 1")
    return ShimConfig(
        host=args.host,
        port=args.port,
        engine=engine,
        served_model_name=args.served_model_name,
        tokenizer=args.tokenizer,
        kv_events=kv,
        data_parallel_size=args.data_parallel_size,
        max_request_body_bytes=args.max_request_body_bytes,
    )


async def serve(config: ShimConfig) -> None:
    from engine_shim.runner import start_shim

    shim = await start_shim(config)
    events = ", ".join(
        f"{ep}" + (f" (replay {rep})" if rep else "") for ep, rep in shim.events_endpoints if ep
    )
    print(f"engine-shim ready on {shim.url} events {events or 'off'}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await shim.stop()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as e:
        print(f"engine-shim: error: {e}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(config))
    except (BackendUnavailable, TokenizerUnavailable, OSError, ValueError, RuntimeError) as e:
        print(f"engine-shim: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
