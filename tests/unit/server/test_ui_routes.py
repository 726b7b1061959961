"""The built-in page's routes: served from the package by default, absent (404) with --no-ui."""

from __future__ import annotations

import argparse

from fastapi.testclient import TestClient

from sidecar.server.flags import add_config_arguments, config_from_args
from sidecar.server.openai.api import HttpSettings, create_app
from test_openai_support import FakeService


def test_page_and_assets_are_served_from_the_package():
    client = TestClient(create_app(FakeService()))
    page = client.get("/")
    assert page.status_code == 200 and '<script src="/ui/app.js"' in page.text
    for name in ("app.js", "style.css"):
        assert client.get(f"/ui/{name}").status_code == 200
    for name in ("index.html", "__init__.py", "..%2F__init__.py"):
        r = client.get(f"/ui/{name}")
        assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"


def test_no_ui_leaves_the_routes_out():
    client = TestClient(create_app(FakeService(), settings=HttpSettings(ui=False)))
    assert client.get("/").status_code == 404 and client.get("/ui/app.js").status_code == 404
    assert client.get("/health").status_code == 200


def test_no_ui_flag_and_store_bounds_reach_the_config():
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    args = [
        "--no-ui",
        "--responses-max-entries",
        "5",
        "--responses-max-bytes",
        "4096",
        "--responses-ttl",
        "60",
    ]
    cfg = config_from_args(parser.parse_args(args), env={})
    s = HttpSettings.from_config(cfg.server, None)
    assert (s.ui, s.responses_max_entries, s.responses_max_bytes, s.responses_ttl_s) == (False, 5, 4096, 60.0)
    default = HttpSettings.from_config(config_from_args(parser.parse_args([]), env={}).server, None)
    assert default.ui and default.responses_max_entries == 1000
