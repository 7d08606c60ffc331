"""Router settings: flags > environment (PREFIX_ROUTER_*) > YAML (--config) > defaults.

Every setting has one name used everywhere: the field of RouterConfig, the YAML key (``-`` or
``_``), the flag ``--name-with-dashes`` and the variable ``PREFIX_ROUTER_NAME``. ``OPTIONS``
below is the single table they are all generated from, so the documentation
(``prefix-router serve --help``) cannot drift from the parser.

List and map values in the environment: ``PREFIX_ROUTER_ENGINES`` holds engine specs
separated by spaces or ``;`` (a spec itself contains commas), ``PREFIX_ROUTER_HASH_SEEDS`` is
comma-separated, ``PREFIX_ROUTER_LORA_ADAPTERS`` is ``name=path,name=path``.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from events.hashing import ALGORITHMS, LoRA

from .instance import EngineSpec, InstanceKey, offset_endpoint_port

__all__ = [
    "OPTIONS",
    "ConfigError",
    "EngineSpec",
    "InstanceKey",
    "RouterConfig",
    "add_serve_arguments",
    "load_config",
    "parse_engine_flag",
]

ENV_PREFIX = "PREFIX_ROUTER_"


class ConfigError(ValueError):
    """A setting is invalid; the message names the setting and where it came from."""


# --------------------------------------------------------------------------------------
# Engines


_ENGINE_KEYS = ("events", "replay", "dp", "hash_seed")


def _check_endpoint(value: str, what: str, src: str) -> str:
    if value.lower() in ("none", "off"):
        return "none"
    if not re.match(r"^(tcp|ipc|inproc)://", value):
        raise ConfigError(f"{what}={value!r} in {src!r}: expected tcp://HOST:PORT")
    if value.startswith("tcp://"):
        _, _, port = value.rpartition(":")
        if not port.isdigit():
            raise ConfigError(f"{what}={value!r} in {src!r}: missing or invalid port")
    return value


def _check_url(url: str, src: str) -> str:
    u = urlsplit(url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ConfigError(f"engine URL {url!r} in {src!r}: expected http(s)://HOST:PORT")
    try:
        u.port  # noqa: B018 - raises on a bad port
    except ValueError as e:
        raise ConfigError(f"engine URL {url!r} in {src!r}: {e}") from e
    return url


def _engine_from_parts(url: str, opts: Mapping[str, Any], src: str) -> EngineSpec:
    unknown = set(opts) - set(_ENGINE_KEYS)
    if unknown:
        raise ConfigError(
            f"unknown engine option(s) {sorted(unknown)} in {src!r}; "
            f"allowed: {', '.join(_ENGINE_KEYS)}"
        )
    try:
        dp = int(opts.get("dp", 1))
    except (TypeError, ValueError):
        raise ConfigError(f"dp={opts.get('dp')!r} in {src!r}: expected an integer >= 1") from None
    if dp < 1:
        raise ConfigError(f"dp={dp} in {src!r}: expected an integer >= 1")
    events = opts.get("events")
    replay = opts.get("replay")
    spec = EngineSpec(
        url=_check_url(str(url), src),
        events=None if events is None else _check_endpoint(str(events), "events", src),
        replay=None if replay is None else _check_endpoint(str(replay), "replay", src),
        dp=dp,
        hash_seed=None if opts.get("hash_seed") is None else str(opts["hash_seed"]),
    )
    for r in range(dp):  # ipc endpoints cannot serve dp > 1: say so now, not at connect time
        try:
            offset_endpoint_port(spec.events_endpoint(0), r)
            offset_endpoint_port(spec.replay_endpoint(0), r)
        except ValueError as e:
            raise ConfigError(f"{src!r}: {e}") from None
    return spec


def parse_engine_flag(s: str) -> EngineSpec:
    """``URL[,events=tcp://H:P][,replay=tcp://H:P][,dp=N][,hash_seed=S]`` -> EngineSpec."""
    if not isinstance(s, str) or not s.strip():
        raise ConfigError("empty --engine value; expected URL[,events=tcp://H:P][,replay=...]")
    parts = [p.strip() for p in s.strip().split(",")]
    url, opts = parts[0], {}
    for p in parts[1:]:
        if not p:
            continue
        k, eq, v = p.partition("=")
        k = k.strip().replace("-", "_")
        if not eq or not v.strip():
            raise ConfigError(f"engine option {p!r} in {s!r}: expected KEY=VALUE")
        if k in opts:
            raise ConfigError(f"engine option {k!r} given twice in {s!r}")
        opts[k] = v.strip()
    return _engine_from_parts(url, opts, s)


def _engine_from_yaml(item: Any, i: int) -> EngineSpec:
    if isinstance(item, str):
        return parse_engine_flag(item)
    if isinstance(item, Mapping) and "url" in item:
        opts = {str(k).replace("-", "_"): v for k, v in item.items() if k != "url"}
        return _engine_from_parts(item["url"], opts, f"engines[{i}]")
    raise ConfigError(f"engines[{i}]: expected a string or a mapping with 'url', got {item!r}")


# --------------------------------------------------------------------------------------
# The settings table


@dataclass
class RouterConfig:
    host: str = "0.0.0.0"
    port: int = 8000
    engines: list[EngineSpec] = field(default_factory=list)
    discovery: str | None = None
    discovery_interval_s: float = 10.0
    index: str = "memory"
    hash_scheme: str = "auto"
    hash_algo: str = "sha256_cbor"
    hash_seed: str | None = None
    hash_seeds: list[str] = field(default_factory=list)
    block_size: int = 16
    tokenizer: str | None = None
    model: str | None = None
    lora_adapters: dict[str, LoRA] = field(default_factory=dict)
    load_weight: float = 0.5
    temperature: float = 0.0
    max_share: float = 0.5
    in_flight_tokens: float = 32.0
    pending_ttl_s: float = 2.0
    admin_token: str | None = None
    max_body_bytes: int = 32 * 1024 * 1024
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 5.0
    retries: int = 2
    health_interval_s: float = 2.0
    log_level: str = "info"
    log_format: str = "json"
    log_prompts: bool = False
    salt_by_api_key: bool = False
    config: str | None = None  # the YAML file these settings came from, if any

    def instances(self) -> list[InstanceKey]:
        return [k for e in self.engines for k in e.instances()]


@dataclass(frozen=True)
class Option:
    name: str
    help: str
    kind: str = "str"  # str, int, float, bool, engines, list, lora
    choices: tuple[str, ...] | None = None
    metavar: str | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()


OPTIONS: tuple[Option, ...] = (
    Option("host", "address to listen on"),
    Option("port", "port to listen on", "int"),
    Option(
        "engines",
        "an engine: URL[,events=tcp://H:P][,replay=tcp://H:P][,dp=N][,hash_seed=S]; "
        "repeatable. events/replay default to the URL's host on ports 5557/5558, +rank per dp "
        "rank; replay=none disables gap repair",
        "engines",
        metavar="SPEC",
    ),
    Option(
        "discovery",
        "DNS discovery of a headless Service: dns://NAME:HTTP_PORT?events=P&replay=P&dp=N",
    ),
    Option("discovery_interval_s", "seconds between DNS re-resolutions", "float"),
    Option("index", "block index: memory, or a redis:// URL shared by router replicas"),
    Option(
        "hash_scheme",
        "auto: detect and adopt each engine's hash scheme; fixed: only report mismatches "
        "(an algorithm name means fixed with that algorithm)",
        choices=("auto", "fixed", *ALGORITHMS),
    ),
    Option("hash_algo", "engines' --prefix-caching-hash-algo", choices=ALGORITHMS),
    Option("hash_seed", "engines' PYTHONHASHSEED (unset: vLLM's default NONE_HASH)"),
    Option("hash_seeds", "extra PYTHONHASHSEED values to try on a mismatch", "list"),
    Option("block_size", "engines' block size (events tell the real one)", "int"),
    Option(
        "tokenizer",
        "tokenizer directory; 'engine' uses the engines' /tokenize; default: the bundled one",
    ),
    Option("model", "served model name (default: what the engines report)"),
    Option(
        "lora_adapters",
        "LoRA adapter NAME=PATH as the engines load it (vLLM hashes the path); repeatable",
        "lora",
        metavar="NAME=PATH",
    ),
    Option("load_weight", "tokens of cost per queued token (0: ignore load)", "float"),
    Option("temperature", "softmax temperature over -cost, in tokens (0: argmin)", "float"),
    Option("max_share", "cap on one instance's share of in-flight requests (1: no cap)", "float"),
    Option("in_flight_tokens", "tokens of cost per in-flight request (decode work)", "float"),
    Option(
        "pending_ttl_s", "seconds a routed prompt's blocks count before events confirm", "float"
    ),
    Option("admin_token", "bearer token required by /debug and admin routes"),
    Option("max_body_bytes", "largest request body accepted", "int"),
    Option("request_timeout_s", "upstream request timeout", "float"),
    Option("connect_timeout_s", "upstream connect timeout", "float"),
    Option("retries", "retries on another instance before the first byte", "int"),
    Option("health_interval_s", "seconds between GET /health probes", "float"),
    Option(
        "log_level", "debug, info, warning, error", choices=("debug", "info", "warning", "error")
    ),
    Option("log_format", "json or text", choices=("json", "text")),
    Option("log_prompts", "log prompt text (off: only sizes and hashes)", "bool"),
    Option("salt_by_api_key", "derive a cache_salt from the API key when none is given", "bool"),
)
_BY_NAME = {o.name: o for o in OPTIONS}
_YAML_ALIASES = {"engine": "engines", "lora": "lora_adapters", "loras": "lora_adapters"}


def _to_bool(v: Any, src: str) -> bool:
    if isinstance(v, bool):
        return v
    s = str(v).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(f"{src}: expected a boolean (true/false), got {v!r}")


def _parse_lora(v: str, src: str) -> tuple[str, str]:
    name, eq, path = v.partition("=")
    if not eq or not name.strip() or not path.strip():
        raise ConfigError(f"{src}: expected NAME=PATH, got {v!r}")
    return name.strip(), path.strip()


def _convert(opt: Option, raw: Any, src: str) -> Any:
    """A raw value (str from flags/env, any from YAML) -> the field's type."""
    if raw is None:
        return None
    try:
        if opt.kind == "int":
            if isinstance(raw, bool):
                raise ValueError
            return int(raw)
        if opt.kind == "float":
            if isinstance(raw, bool):
                raise ValueError
            return float(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"{src}: expected a number, got {raw!r}") from None
    if opt.kind == "bool":
        return _to_bool(raw, src)
    if opt.kind == "engines":
        if isinstance(raw, str):
            raw = [p for p in re.split(r"[\s;]+", raw) if p]
        if not isinstance(raw, list):
            raise ConfigError(f"{src}: expected a list of engines")
        return [_engine_from_yaml(x, i) for i, x in enumerate(raw)]
    if opt.kind == "list":
        if isinstance(raw, str):
            raw = [p.strip() for p in raw.split(",") if p.strip()]
        if not isinstance(raw, list):
            raise ConfigError(f"{src}: expected a list")
        return [str(x) for x in raw]
    if opt.kind == "lora":
        out: dict[str, LoRA] = {}
        if isinstance(raw, str):
            raw = [p for p in raw.split(",") if p.strip()]
        if isinstance(raw, Mapping):
            items = [(str(k), str(v)) for k, v in raw.items()]
        elif isinstance(raw, list):
            items = []
            for x in raw:
                if isinstance(x, Mapping) and "name" in x and "path" in x:
                    items.append((str(x["name"]), str(x["path"])))
                elif isinstance(x, str):
                    items.append(_parse_lora(x, src))
                else:
                    raise ConfigError(f"{src}: expected NAME=PATH or {{name, path}}, got {x!r}")
        else:
            raise ConfigError(f"{src}: expected a mapping NAME: PATH")
        for name, path in items:
            out[name] = LoRA(name, path)
        return out
    value = str(raw)
    if opt.choices and value not in opt.choices:
        raise ConfigError(f"{src}: {value!r} is not one of {', '.join(opt.choices)}")
    return value


def add_serve_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Every setting as a flag (defaults stay unset so env and YAML can fill them)."""
    parser.add_argument(
        "--config", metavar="FILE", default=None, help="YAML file of settings (keys as below)"
    )
    for o in OPTIONS:
        kw: dict[str, Any] = {
            "dest": o.name,
            "default": None,
            "help": f"{o.help} [env {o.env}; default {_default_text(o)}]",
        }
        if o.kind == "engines":
            parser.add_argument("--engine", action="append", metavar=o.metavar, **kw)
        elif o.kind == "lora":
            parser.add_argument(
                "--lora", "--lora-adapter", action="append", metavar=o.metavar, **kw
            )
        elif o.kind == "list":
            parser.add_argument(o.flag, "--hash-seed-candidate", action="append", **kw)
        elif o.kind == "bool":
            parser.add_argument(o.flag, action=argparse.BooleanOptionalAction, **kw)
        else:
            if o.choices:
                kw["choices"] = o.choices
            parser.add_argument(o.flag, metavar=o.metavar, **kw)
    return parser


def _default_text(o: Option) -> str:
    d = RouterConfig.__dataclass_fields__[o.name]
    if d.default is MISSING or d.default is None:
        return "none"
    return str(d.default)


def _read_yaml(path: str | Path) -> dict[str, Any]:
    import yaml

    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {str(p)!r} not found") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(p)!r} is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r}: expected a mapping of settings")
    out = {}
    for k, v in data.items():
        name = str(k).replace("-", "_")
        name = _YAML_ALIASES.get(name, name)
        if name not in _BY_NAME:
            raise ConfigError(
                f"config file {str(p)!r}: unknown setting {k!r}; known: {', '.join(_BY_NAME)}"
            )
        out[name] = v
    return out


def load_config(
    argv: Sequence[str] | None = None,
    env: Mapping[str, str] | None = None,
    yaml_path: str | Path | None = None,
) -> RouterConfig:
    """Merge the sources (flags > env > YAML > defaults) and validate the result."""
    parser = argparse.ArgumentParser(prog="prefix-router serve", exit_on_error=False)
    add_serve_arguments(parser)
    try:
        args = parser.parse_args(list(argv or []))
    except argparse.ArgumentError as e:
        raise ConfigError(str(e)) from None
    env = env or {}
    yaml_path = args.config or yaml_path or env.get(ENV_PREFIX + "CONFIG")
    ydata = _read_yaml(yaml_path) if yaml_path else {}

    values: dict[str, Any] = {}
    for o in OPTIONS:
        raw_flag = getattr(args, o.name, None)
        if raw_flag is not None:
            if o.kind == "engines":
                values[o.name] = [parse_engine_flag(s) for s in raw_flag]
            elif o.kind == "list":
                values[o.name] = [p.strip() for s in raw_flag for p in s.split(",") if p.strip()]
            elif o.kind == "lora":
                values[o.name] = _convert(o, list(raw_flag), o.flag)
            else:
                values[o.name] = _convert(o, raw_flag, o.flag)
        elif o.env in env:
            values[o.name] = _convert(o, env[o.env], o.env)
        elif o.name in ydata:
            values[o.name] = _convert(o, ydata[o.name], f"{yaml_path}: {o.name}")
    cfg = RouterConfig(**{k: v for k, v in values.items() if v is not None})
    cfg.config = str(yaml_path) if yaml_path else None
    _validate(cfg)
    return cfg


def _validate(cfg: RouterConfig) -> None:
    if cfg.hash_scheme in ALGORITHMS:
        cfg.hash_algo, cfg.hash_scheme = cfg.hash_scheme, "fixed"
    if not cfg.engines and not cfg.discovery:
        raise ConfigError(
            "no engines: pass --engine URL (repeatable), --discovery dns://..., "
            f"{ENV_PREFIX}ENGINES or 'engines:' in the --config file"
        )
    urls = [e.url for e in cfg.engines]
    dups = {u for u in urls if urls.count(u) > 1}
    if dups:
        raise ConfigError(f"engine(s) configured twice: {', '.join(sorted(dups))}")
    if cfg.discovery is not None and not cfg.discovery.startswith("dns://"):
        raise ConfigError(f"--discovery {cfg.discovery!r}: expected dns://NAME:PORT?events=P")
    if not 0 < cfg.port < 65536:
        raise ConfigError(f"--port {cfg.port}: expected 1-65535")
    if cfg.block_size <= 0:
        raise ConfigError(f"--block-size {cfg.block_size}: must be positive")
    if cfg.index != "memory" and not cfg.index.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigError(f"--index {cfg.index!r}: expected memory or a redis:// URL")
    for name in ("load_weight", "temperature", "pending_ttl_s", "in_flight_tokens"):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 0")
    if not 0 < cfg.max_share <= 1:
        raise ConfigError(f"--max-share {cfg.max_share}: expected a fraction in (0, 1]")
    for name in ("max_body_bytes", "request_timeout_s", "connect_timeout_s", "health_interval_s"):
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be > 0")
    if cfg.retries < 0:
        raise ConfigError("--retries must be >= 0")
    if cfg.discovery_interval_s <= 0:
        raise ConfigError("--discovery-interval-s must be > 0")


def config_fields() -> list[str]:
    return [f.name for f in fields(RouterConfig)]
