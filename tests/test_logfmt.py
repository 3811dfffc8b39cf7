"""Structured logs keep the facts of an event as fields."""

from __future__ import annotations

import json
import logging

from ckpt.logfmt import JsonFormatter, TextFormatter


def _record(**extra: object) -> logging.LogRecord:
    log = logging.getLogger("gpuckpt.test")
    rec = log.makeRecord("gpuckpt.test", logging.INFO, __file__, 1, "checkpoint %s", ("saved",), None, extra=extra)
    return rec


def test_json_lines_carry_extra_fields() -> None:
    line = JsonFormatter().format(_record(checkpoint="20261129T000000000Z-abcdef01", blocks=3, ratio=1.5, obj=object()))
    doc = json.loads(line)
    assert doc["message"] == "checkpoint saved"
    assert doc["level"] == "info"
    assert doc["logger"] == "gpuckpt.test"
    assert doc["checkpoint"] == "20261129T000000000Z-abcdef01"
    assert doc["blocks"] == 3
    assert doc["ratio"] == 1.5
    assert doc["obj"].startswith("<object object")
    assert doc["time"].endswith("+00:00")
    assert "\n" not in line


def test_text_lines_are_key_value() -> None:
    line = TextFormatter().format(_record(blocks=3, worker="w0"))
    assert line == 'gpuckpt: info: gpuckpt.test: checkpoint saved blocks=3 worker="w0"'


def test_save_logs_are_structured(tmp_path, caplog) -> None:  # type: ignore[no-untyped-def]
    import torch

    from ckpt import Block, Namespace, Pins, Repository, WorkerFacts, host_facts

    repo = Repository.open(str(tmp_path / "r"), create=True)
    caplog.set_level(logging.INFO, logger="gpuckpt")
    m = repo.save(
        [Block.from_tensor(b"k", torch.zeros(4, dtype=torch.float16))],
        worker_id="w0",
        namespace=Namespace({"engine": "t"}),
        pins=Pins(host=host_facts(), worker=WorkerFacts()),
    )
    rec = next(r for r in caplog.records if r.getMessage() == "checkpoint saved")
    doc = json.loads(JsonFormatter().format(rec))
    assert doc["checkpoint"] == m.id
    assert doc["worker"] == "w0"
    assert doc["blocks"] == 1
