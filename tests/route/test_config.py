"""Config from flags and YAML; every mistake is one line through the CLI."""

from __future__ import annotations

import pytest

from kvtier.cli import main
from kvtier.errors import ConfigError
from kvtier.route.config import RouteConfig, merge_flags


def test_flags_pair_event_endpoints_by_position_or_name():
    cfg = merge_flags({}, ["http://a:1", "http://b:2"], ["tcp://a:5", "tcp://b:6"], ["http://b:2=tcp://b:7"], {"port": 9})
    assert [(e.url, e.kv_events, e.kv_replay) for e in cfg.engines] == [
        ("http://a:1", "tcp://a:5", None), ("http://b:2", "tcp://b:6", "tcp://b:7")]
    assert cfg.port == 9 and cfg.prefix_weight == 2.0 and cfg.load_weight == 1.0


def test_yaml_file_and_flags_override(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("engines:\n  - {url: http://a:1, kv_events: tcp://a:5}\nprefix_weight: 3\n"
                    "tier_weights: {gpu: 1, disk: 0.1}\nshared_media: [s3]\n")
    from kvtier.route.config import load_file

    cfg = merge_flags(load_file(path), [], [], [], {"load_weight": 0.5})
    assert cfg.prefix_weight == 3.0 and cfg.load_weight == 0.5
    assert cfg.weight_of("DISK") == 0.1 and cfg.weight_of("nvme") == 0.1 and cfg.shared_media == ("S3",)


@pytest.mark.parametrize("data, fragment", [
    ({"engines": ["http://a"], "bogus": 1}, "route: unknown key 'bogus'; valid keys:"),
    ({"engines": []}, "at least one --engine"),
    ({"engines": ["a:1"]}, "must start with http://"),
    ({"engines": ["http://a", "http://a"]}, "twice"),
    ({"engines": [{"url": "http://a", "kv_events": "udp://x"}]}, "tcp://"),
    ({"engines": ["http://a"], "prefix_weight": "x"}, "route.prefix_weight: expected a"),
    ({"engines": ["http://a"], "balance_ratio": 0.5}, "balance_ratio"),
    ({"engines": ["http://a"], "health_interval_s": 0}, "health_interval_s"),
    ({"engines": [{"uri": "http://a"}]}, "route.engines[0]: unknown key 'uri'"),
])
def test_bad_config_is_one_config_error(data, fragment):
    with pytest.raises(ConfigError) as info:
        RouteConfig.from_dict(data)
    assert fragment in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("argv, fragment", [
    (["route", "--engine", "http://a", "--kv-events", "tcp://a:1", "--kv-events", "tcp://b:1"], "2 endpoints for 1 engines"),
    (["route", "--engine", "http://a", "--kv-events", "http://z=tcp://a:1"], "not one of the --engine URLs"),
    (["route", "--config", "/nonexistent/r.yaml"], "cannot read config"),
    (["route"], "at least one --engine"),
])
def test_cli_errors_are_one_line_exit_2(argv, fragment, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert fragment in err and "\n" not in err and err.startswith("kvtier route: error:")


def test_missing_router_dependency_is_one_line(monkeypatch, capsys):
    import sys

    for name in [m for m in sys.modules if m == "aiohttp" or m.startswith(("aiohttp.", "kvtier.route.proxy"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "aiohttp", None)
    assert main(["route", "--engine", "http://a:1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "'aiohttp'" in err and "pip install 'kvtier[route]'" in err


def test_front_door_flags_and_sizes():
    from kvtier.cli import build_parser
    from kvtier.cli.route import build_config

    args = build_parser().parse_args(["route", "--engine", "http://a:1", "--max-body-bytes", "2MiB",
                                      "--first-byte-timeout", "5", "--stream-idle-timeout", "7",
                                      "--max-connections", "10"])
    cfg = build_config(args)
    assert (cfg.max_body_bytes, cfg.first_byte_timeout_s, cfg.stream_idle_timeout_s, cfg.max_connections) == \
        (2 * 1024**2, 5.0, 7.0, 10)
    with pytest.raises(ConfigError, match="max_body_bytes_total: must be >= max_body_bytes"):
        RouteConfig.from_dict({"engines": ["http://a"], "max_body_bytes": "1GiB"})
    with pytest.raises(ConfigError, match=r"route.first_byte_timeout_s: must be in \(0, inf\)"):
        RouteConfig.from_dict({"engines": ["http://a"], "first_byte_timeout_s": 0})


@pytest.mark.parametrize("url", ["ftp://bob:hunter2@h:1", "http://bob:hunter2@h:99999", "http://bob:hunter2@"])
def test_engine_credentials_never_appear_in_config_errors(url):
    with pytest.raises(ConfigError) as info:
        RouteConfig.from_dict({"engines": [url]})
    assert "hunter2" not in str(info.value) and "bob" not in str(info.value)


def test_engine_name_and_basic_auth_from_the_url():
    cfg = RouteConfig.from_dict({"engines": ["http://bob:p%40ss@h:8000/", "http://h:8001"]})
    a, b = cfg.engines
    assert a.name == "http://h:8000" and "bob" not in repr(cfg) and b.authorization is None
    assert a.authorization == "Basic Ym9iOnBAc3M="  # bob:p@ss
    with pytest.raises(ConfigError, match="twice"):
        RouteConfig.from_dict({"engines": ["http://bob:x@h:8000", "http://h:8000"]})
