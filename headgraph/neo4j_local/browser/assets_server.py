"""Serve style.grass and guide.html on 127.0.0.1 so Neo4j Browser can fetch them (`:style URL`, `:play URL`).

Browser runs in the page's origin (the Neo4j HTTP port) and fetches with `pragma`/`cache-control` headers, so
the answer needs CORS headers and a preflight (OPTIONS) reply. Only the two asset files are served.
"""

from __future__ import annotations

import argparse
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ASSETS = {"/style.grass": "text/plain; charset=utf-8", "/guide.html": "text/html; charset=utf-8"}
FOLDER = Path(__file__).parent


class AssetHandler(SimpleHTTPRequestHandler):
    """GET/HEAD of the two asset files with permissive CORS; 404 for anything else."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, directory=str(FOLDER), **kwargs)

    def end_headers(self):
        self.send_header("Access-Control-Allow-Origin", "*")
        self.send_header("Access-Control-Allow-Headers", "pragma, cache-control")
        self.send_header("Cache-Control", "no-store")
        super().end_headers()

    def guess_type(self, path):
        return ASSETS.get("/" + Path(path).name, "application/octet-stream")

    def send_head(self):
        if self.path.split("?", 1)[0] not in ASSETS:
            self.send_error(404, "only /style.grass and /guide.html are served here")
            return None
        self.path = self.path.split("?", 1)[0]
        return super().send_head()

    def do_OPTIONS(self):
        self.send_response(204)
        self.send_header("Access-Control-Allow-Methods", "GET, HEAD, OPTIONS")
        self.end_headers()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=7480)
    args = parser.parse_args(argv)
    ThreadingHTTPServer(("127.0.0.1", args.port), AssetHandler).serve_forever()


if __name__ == "__main__":
    main()
