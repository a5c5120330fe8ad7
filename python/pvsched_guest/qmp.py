"""QMP, QEMU's monitor protocol: one command per connection."""

import json
import socket

from .host import Failure


def qmp(path, command, arguments=None):
    """Runs `command` on the QMP socket at `path` on a fresh connection and
    returns its "return" value; Failure if QEMU answers with an error."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(path))
        f = s.makefile("rwb")
        json.loads(f.readline())  # greeting
        for cmd in ("qmp_capabilities", command):
            req = {"execute": cmd}
            if cmd == command and arguments:
                req["arguments"] = arguments
            f.write(json.dumps(req).encode() + b"\n")
            f.flush()
            while True:
                msg = json.loads(f.readline())
                if "return" in msg or "error" in msg:
                    break
            if "error" in msg:
                raise Failure(f"QMP {cmd}: {msg['error']}")
        return msg["return"]
