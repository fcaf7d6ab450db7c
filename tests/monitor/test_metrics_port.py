"""Evaluator(metrics_port=...) serves Prometheus metrics from the creating
process until close()."""
from __future__ import annotations

import urllib.request

import pytest

import shmeval
from helpers import INPUT_SHAPE, OUTPUTS, fake_factory, make_ev, make_state


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return str(r.read().decode())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["thread", "spawn"])
def test_metrics_port_serves_until_close(kind: str) -> None:
    if kind == "thread":
        ev = make_ev(metrics_port=0)
    else:
        ev = shmeval.Evaluator.spawn(fake_factory, input_shape=INPUT_SHAPE, outputs=OUTPUTS,
                                     metrics_port=0)
    with ev:
        port = ev.metrics_port
        assert port
        for tag in range(5):
            ev.evaluate(make_state(tag))
        text = scrape(port)
        assert "shmeval_requests_total 5.0" in text, text[:2000]
    with pytest.raises(OSError):
        scrape(port)
    assert ev.metrics_port == port


@pytest.mark.parametrize("port", [-1, 70000, 1.5, "80"])
def test_a_bad_metrics_port_is_refused_before_anything_starts(port: object) -> None:
    with pytest.raises(ValueError, match="metrics_port"):
        make_ev(metrics_port=port)
