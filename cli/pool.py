"""`tandem pool`: look at and change a running server's worker pools through its admin API
(`GET /admin/pools`, `POST /admin/pools`, `POST /admin/workers/{id}/drain` and `/role`).

HTTP goes through urllib alone, so this command needs nothing `tandem serve` needs and
`tandem --help` stays light. Every failure is a CliError: one line, non-zero exit.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable

from cli.errors import CliError
from loadtest.cli import DefaultsFormatter

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
REQUEST_TIMEOUT_S = 10.0
POLL_INTERVAL_S = 0.1
MIN_POLL_TIMEOUT_S = 1.0  # a poll near the --wait deadline still gets a fair chance to answer
POOLS = ("prefill", "decode", "colocated")
SERVING = "serving"


class AdminClient:
    """The admin routes of one server. Each call returns the pool view the server answers
    with (`{"workers": [...], "restarts": {...}}`) or raises CliError."""

    def __init__(
        self, base_url: str, api_key: str | None, timeout: float = REQUEST_TIMEOUT_S
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise CliError(f"--base-url must start with http:// or https://, not {base_url!r}")
        # The server's root: an OpenAI SDK's base URL ends in /v1, which no admin route has.
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.api_key = api_key
        self.timeout = timeout

    def pools(self, timeout: float | None = None) -> dict:
        return self._request("GET", "/admin/pools", timeout=timeout)

    def scale(self, sizes: dict[str, int]) -> dict:
        return self._request("POST", "/admin/pools", sizes)

    def drain(self, worker_id: str) -> dict:
        return self._request(
            "POST", f"/admin/workers/{urllib.parse.quote(worker_id, safe='')}/drain"
        )

    def switch_role(self, worker_id: str, role: str) -> dict:
        worker = urllib.parse.quote(worker_id, safe="")
        return self._request("POST", f"/admin/workers/{worker}/role", {"role": role})

    def _request(
        self, method: str, path: str, body: dict | None = None, timeout: float | None = None
    ) -> dict:
        headers = {"Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        request = urllib.request.Request(self.base_url + path, data, headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=timeout or self.timeout) as reply:
                raw = reply.read()
        except urllib.error.HTTPError as err:
            raise CliError(_describe_refusal(method, path, err)) from None
        except urllib.error.URLError as err:
            raise CliError(f"cannot reach {self.base_url}: {err.reason}") from None
        except OSError as err:  # a timeout or a dropped connection while reading
            raise CliError(f"{method} {path} on {self.base_url} failed: {err}") from None
        return _pool_view(raw, f"{method} {path}")


def _describe_refusal(method: str, path: str, err: urllib.error.HTTPError) -> str:
    """One line from an error answer: the server's own message when it sent OpenAI's shape."""
    try:
        message = json.loads(err.read())["error"]["message"]
    except (OSError, ValueError, KeyError, TypeError):
        message = err.reason
    line = f"{method} {path}: HTTP {err.code}: {message}"
    if err.code == 401:
        line += " (pass --api-key or set TANDEM_API_KEY)"
    return " ".join(line.split())


def _pool_view(raw: bytes, what: str) -> dict:
    try:
        view = json.loads(raw)
    except ValueError:
        raise CliError(f"{what}: the answer is not JSON; is this a tandem server?") from None
    if not (isinstance(view, dict) and isinstance(view.get("workers"), list)):
        raise CliError(f"{what}: the answer is not a pool view; is this a tandem server?")
    return view


# -- the command --------------------------------------------------------------------------


def add_parser(commands: argparse._SubParsersAction) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--base-url", default=DEFAULT_BASE_URL, help="the server")
    common.add_argument(
        "--api-key",
        default=os.environ.get("TANDEM_API_KEY"),
        help="sent as 'Authorization: Bearer KEY'; default: $TANDEM_API_KEY, else none",
    )
    common.add_argument("--json", action="store_true", help="print the server's JSON as is")
    waiting = argparse.ArgumentParser(add_help=False)
    waiting.add_argument(
        "--wait",
        type=_positive_seconds,
        metavar="S",
        help="then wait up to S seconds for the change to take effect; exit 1 if it does not",
    )

    p = commands.add_parser(
        "pool",
        help="list, scale, drain or switch the roles of a running server's workers",
        description="Look at and change a running server's worker pools (its /admin API).",
    )
    actions = p.add_subparsers(dest="action", required=True)
    kwargs = {"formatter_class": DefaultsFormatter}
    listing = actions.add_parser(
        "list", parents=[common], help="workers, their load and restarts per pool", **kwargs
    )
    listing.set_defaults(run=run_list)
    scale = actions.add_parser(
        "scale", parents=[common, waiting], help="set pool sizes (shrinking drains)", **kwargs
    )
    for pool in POOLS:
        scale.add_argument(
            f"--{pool}", type=_worker_count, metavar="N", help=f"{pool} workers wanted"
        )
    scale.set_defaults(run=run_scale)
    drain = actions.add_parser(
        "drain", parents=[common, waiting], help="retire a worker once it is idle", **kwargs
    )
    drain.add_argument("worker_id", help="as `tandem pool list` shows it")
    drain.set_defaults(run=run_drain)
    role = actions.add_parser(
        "role", parents=[common], help="move a worker to the other pool (same weights)", **kwargs
    )
    role.add_argument("worker_id", help="as `tandem pool list` shows it")
    role.add_argument("role", choices=["prefill", "decode"])
    role.set_defaults(run=run_role)


def _worker_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid worker count: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"a worker count is 0 or more, not {value}")
    return value


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid seconds: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"--wait takes seconds above 0, not {text}")
    return value


def run_list(args: argparse.Namespace) -> int:
    _show(AdminClient(args.base_url, args.api_key).pools(), args.json)
    return 0


def run_scale(args: argparse.Namespace) -> int:
    sizes = {pool: getattr(args, pool) for pool in POOLS if getattr(args, pool) is not None}
    if not sizes:
        raise CliError("name at least one pool size: --prefill N, --decode M or both")
    client = AdminClient(args.base_url, args.api_key)
    view = client.scale(sizes)
    if args.wait is not None:
        view = wait_for(client.pools, lambda v: _scale_pending(v, sizes), args.wait)
    _show(view, args.json)
    return 0


def run_drain(args: argparse.Namespace) -> int:
    client = AdminClient(args.base_url, args.api_key)
    view = client.drain(args.worker_id)
    if args.wait is not None:
        view = wait_for(client.pools, lambda v: _drain_pending(v, args.worker_id), args.wait)
    _show(view, args.json)
    return 0


def run_role(args: argparse.Namespace) -> int:
    view = AdminClient(args.base_url, args.api_key).switch_role(args.worker_id, args.role)
    _show(view, args.json)
    if not args.json:
        print(f"{args.worker_id} serves as {args.role} after {view['switch_seconds']:.3f}s")
    return 0


# -- waiting --------------------------------------------------------------------------------


def wait_for(
    fetch: Callable[[float], dict], pending: Callable[[dict], str | None], wait_s: float
) -> dict:
    """Polls `fetch(timeout)` until `pending(view)` is None, then returns that view. `pending`
    says what is still missing; after `wait_s` seconds that becomes the CliError's message."""
    deadline = time.monotonic() + wait_s
    while True:
        remaining = deadline - time.monotonic()
        view = fetch(min(REQUEST_TIMEOUT_S, max(MIN_POLL_TIMEOUT_S, remaining)))
        missing = pending(view)
        if missing is None:
            return view
        if time.monotonic() >= deadline:
            raise CliError(f"gave up after {wait_s:g}s: {missing}")
        time.sleep(min(POLL_INTERVAL_S, max(0.0, deadline - time.monotonic())))


def _scale_pending(view: dict, sizes: dict[str, int]) -> str | None:
    behind = []
    for pool, wanted in sizes.items():
        states = [w["state"] for w in view["workers"] if w["pool"] == pool]
        serving = states.count(SERVING)
        if serving != wanted:
            behind.append(f"{pool} has {serving} serving workers, not {wanted}")
        elif len(states) > wanted:  # a shrink is done once the drained workers have left
            behind.append(f"{pool} has {len(states) - wanted} workers still leaving")
    return "; ".join(behind) or None


def _drain_pending(view: dict, worker_id: str) -> str | None:
    for w in view["workers"]:
        if w["id"] == worker_id:
            return f"worker {worker_id} is still {w['state']}"
    return None


# -- printing -------------------------------------------------------------------------------


def _show(view: dict, as_json: bool) -> None:
    print(json.dumps(view, indent=2) if as_json else format_view(view))


def format_view(view: dict) -> str:
    """The workers as an aligned table, then the restarts per pool."""
    rows = [("ID", "POOL", "STATE", "RUNNING", "WAITING", "KV USAGE")]
    for w in sorted(view["workers"], key=lambda w: (w["pool"], w["id"])):
        usage = f"{w.get('kv_cache_usage', 0.0):.1%}"
        rows.append((w["id"], w["pool"], w["state"], str(w["running"]), str(w["waiting"]), usage))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [_aligned(row, widths) for row in rows]
    restarts = view.get("restarts") or {}
    listed = ", ".join(f"{pool} {count}" for pool, count in sorted(restarts.items()))
    lines.append(f"restarts: {listed or 'none'}")
    return "\n".join(lines)


def _aligned(cells: tuple[str, ...], widths: list[int]) -> str:
    return "  ".join(cell.ljust(width) for cell, width in zip(cells, widths, strict=True)).rstrip()
