"""Config: engine flags, precedence flags > env > YAML > defaults, validation messages."""

from __future__ import annotations

import argparse

import pytest

from events.hashing import LoRA
from router.config import (
    ConfigError,
    EngineSpec,
    RouterConfig,
    add_serve_arguments,
    load_config,
    parse_engine_flag,
)
from router.instance import InstanceKey, offset_endpoint_port


def test_parse_engine_flag_defaults_and_ranks():
    s = parse_engine_flag("http://10.0.0.5:8001/")
    assert s == EngineSpec("http://10.0.0.5:8001")
    assert s.instances() == [InstanceKey("http://10.0.0.5:8001", 0)]
    assert s.events_endpoint(0) == "tcp://10.0.0.5:5557"
    assert s.replay_endpoint(0) == "tcp://10.0.0.5:5558"
    s = parse_engine_flag("http://h:8001,events=tcp://h:6000,replay=tcp://h:7000,dp=3,hash_seed=42")
    assert [str(k) for k in s.instances()] == [
        "http://h:8001",
        "http://h:8001#dp1",
        "http://h:8001#dp2",
    ]
    assert s.events_endpoint(2) == "tcp://h:6002" and s.replay_endpoint(1) == "tcp://h:7001"
    assert s.hash_seed == "42"
    assert parse_engine_flag("http://h:1,replay=none").replay_endpoint(0) is None


@pytest.mark.parametrize(
    ("flag", "msg"),
    [
        ("", "empty"),
        ("h:8001", "http"),
        ("http://h:8001,events=h:5557", "tcp://"),
        ("http://h:8001,dp=0", "dp"),
        ("http://h:8001,dp=x", "dp"),
        ("http://h:8001,colour=red", "unknown engine option"),
        ("http://h:8001,events", "KEY=VALUE"),
        ("http://h:8001,dp=1,dp=2", "twice"),
        ("http://h:8001,events=ipc:///tmp/x,dp=2", "cannot offset"),
        ("http://h:99999", "(?i)port"),
    ],
)
def test_parse_engine_flag_errors(flag, msg):
    with pytest.raises(ConfigError, match=msg):
        parse_engine_flag(flag)


def test_offset_endpoint_port_rule():
    assert offset_endpoint_port("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint_port("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint_port("tcp://*:0", 2) == "tcp://*:0"
    assert offset_endpoint_port("inproc://x", 1) == "inproc://x_dp1"
    assert offset_endpoint_port(None, 3) is None
    with pytest.raises(ValueError):
        offset_endpoint_port("ipc:///tmp/s", 1)


def test_precedence_flags_env_yaml_defaults(tmp_path):
    y = tmp_path / "router.yaml"
    y.write_text(
        """
port: 7000
host: 127.0.0.1
load-weight: 0.25
temperature: 3
engines:
  - http://y1:8000
  - url: http://y2:8000
    events: tcp://y2:6000
    dp: 2
lora_adapters:
  sql: /adapters/sql
hash_seeds: [1, 2]
log_prompts: true
"""
    )
    env = {"PREFIX_ROUTER_PORT": "7100", "PREFIX_ROUTER_LOAD_WEIGHT": "0.5"}
    cfg = load_config(["--port", "7200", "--config", str(y)], env)
    assert cfg.port == 7200  # flag beats env and YAML
    assert cfg.load_weight == 0.5  # env beats YAML
    assert cfg.temperature == 3.0 and cfg.host == "127.0.0.1"  # YAML beats defaults
    assert cfg.max_share == RouterConfig().max_share  # default
    assert [e.url for e in cfg.engines] == ["http://y1:8000", "http://y2:8000"]
    assert cfg.engines[1].events_endpoint(1) == "tcp://y2:6001"
    assert cfg.lora_adapters == {"sql": LoRA("sql", "/adapters/sql")}
    assert cfg.hash_seeds == ["1", "2"] and cfg.log_prompts is True
    assert cfg.config == str(y)
    assert len(cfg.instances()) == 3
    # the yaml_path argument and PREFIX_ROUTER_CONFIG work too
    assert load_config([], {}, y).port == 7000
    assert load_config([], {"PREFIX_ROUTER_CONFIG": str(y)}).port == 7000


def test_env_lists_and_flags():
    env = {
        "PREFIX_ROUTER_ENGINES": "http://a:1,events=tcp://a:5 ; http://b:1",
        "PREFIX_ROUTER_LORA_ADAPTERS": "x=/p/x,y=/p/y",
        "PREFIX_ROUTER_LOG_PROMPTS": "yes",
        "PREFIX_ROUTER_HASH_SEEDS": "3, 4",
    }
    cfg = load_config([], env)
    assert [e.url for e in cfg.engines] == ["http://a:1", "http://b:1"]
    assert set(cfg.lora_adapters) == {"x", "y"} and cfg.log_prompts and cfg.hash_seeds == ["3", "4"]
    cfg = load_config(
        [
            "--engine",
            "http://a:1",
            "--engine",
            "http://b:1,dp=2",
            "--lora",
            "x=/q",
            "--hash-seeds",
            "5",
            "--hash-seeds",
            "6,7",
            "--no-log-prompts",
            "--hash-scheme",
            "sha256",
        ],
        env,
    )
    assert len(cfg.instances()) == 3 and cfg.lora_adapters == {"x": LoRA("x", "/q")}
    assert cfg.hash_seeds == ["5", "6", "7"] and not cfg.log_prompts
    assert (cfg.hash_scheme, cfg.hash_algo) == ("fixed", "sha256")


@pytest.mark.parametrize(
    ("argv", "env", "msg"),
    [
        ([], {}, "no engines"),
        (["--engine", "http://a:1", "--port", "x"], {}, "number"),
        (["--engine", "http://a:1", "--max-share", "0"], {}, "max-share"),
        (["--engine", "http://a:1", "--engine", "http://a:1/"], {}, "twice"),
        (["--engine", "http://a:1", "--index", "postgres://x"], {}, "index"),
        (["--engine", "http://a:1", "--hash-algo", "xxhash"], {}, "invalid choice"),
        (["--engine", "http://a:1"], {"PREFIX_ROUTER_LOG_PROMPTS": "maybe"}, "boolean"),
        (["--engine", "http://a:1"], {"PREFIX_ROUTER_HASH_SCHEME": "bogus"}, "not one of"),
        (["--discovery", "http://x"], {}, "dns://"),
        (["--engine", "http://a:1", "--lora", "nopath"], {}, "NAME=PATH"),
        (["--engine", "http://a:1", "--config", "/nonexistent/r.yaml"], {}, "not found"),
    ],
)
def test_invalid_settings_have_clear_errors(argv, env, msg):
    with pytest.raises(ConfigError, match=msg):
        load_config(argv, env)


def test_yaml_errors(tmp_path):
    y = tmp_path / "r.yaml"
    y.write_text("engines: [http://a:1]\nbogus_key: 1\n")
    with pytest.raises(ConfigError, match="unknown setting 'bogus_key'"):
        load_config([], {}, y)
    y.write_text("- just a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config([], {}, y)
    y.write_text("engines: [{events: tcp://x:1}]\n")
    with pytest.raises(ConfigError, match="url"):
        load_config([], {}, y)


def test_add_serve_arguments_reusable_and_documented():
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    text = p.format_help()
    for flag in ("--engine", "--discovery", "--hash-scheme", "--admin-token", "PREFIX_ROUTER_PORT"):
        assert flag in text
    assert load_config(["--discovery", "dns://svc:8000?events=5557"], {}).discovery
