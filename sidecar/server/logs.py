"""Logging setup: plain text or one JSON object per line, with request ids.

Request-scoped log calls pass ``extra={"request_id": ..., ...}``; the JSON
formatter emits every such extra field, the text formatter appends them as
``key=value`` pairs.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time

# Attributes every LogRecord has; anything else came from ``extra=``.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message",
    "asctime",
    "taskName",
    "color_message",
}


# Line breaks and other control characters from clients (ids, prompts quoted in errors) must not
# start a new log line: in text logs they are written as escapes. JSON lines escape them already.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def escape(text: str) -> str:
    return _CONTROL.sub(lambda m: m.group(0).encode("unicode_escape").decode("ascii"), text)


def _extras(record: logging.LogRecord) -> dict:
    return {k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update(_extras(record))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        exc_text = None
        if record.exc_info:  # the traceback is ours and multi-line by design: appended unescaped
            exc_text = self.formatException(record.exc_info)
        line = escape(f"{self.formatTime(record)} {record.levelname} {record.name}: {record.getMessage()}")
        extras = _extras(record)
        if extras:
            line += " " + " ".join(f"{k}={escape(str(v))}" for k, v in extras.items())
        return line + ("\n" + exc_text if exc_text else "")


def setup_logging(level: str = "info", json_lines: bool = False) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if json_lines else TextFormatter())
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # faiss logs every CPU-feature probe at INFO; only its warnings matter to operators.
    logging.getLogger("faiss.loader").setLevel(max(root.level, logging.WARNING))
    # uvicorn installs its own handlers; route them through ours for one format.
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        lg = logging.getLogger(name)
        lg.handlers = []
        lg.propagate = True
