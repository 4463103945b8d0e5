"""An OpenAI-compatible ``/v1/chat/completions`` judge on the loopback address, shared by the judge tests
(tests/ is on sys.path)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class LoopbackJudge:
    """Serves on 127.0.0.1 (a free port; ``url``) until :meth:`close`: ``reply(text)`` answers the user text of
    each request (the last message's text part): a string is the reply, None an HTTP 500. ``prompts`` and
    ``bodies`` record the requests in arrival order."""

    def __init__(self, reply: Callable[[str], str | None]) -> None:
        self.prompts: list[str] = []
        self.bodies: list[dict] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                content = body["messages"][-1]["content"]
                text = content if isinstance(content, str) else content[-1]["text"]
                server.prompts.append(text)
                server.bodies.append(body)
                answer = reply(text)
                if answer is None:
                    self.send_response(500)
                    self.end_headers()
                    return
                data = json.dumps({"choices": [{"message": {"content": answer}}]}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
