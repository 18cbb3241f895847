"""What the frontend pays per streamed token as an output grows: `RequestState.apply` (detokenize,
stop-string search, the RequestOutput handed to the stream), one token per update.

    python benchmarks/output_fold.py [--model DIR] [--lengths 128 2048 8192 16384] [--json F]

Prints, per output length, the mean cost per token over the whole output and over its last 128
tokens. A cost that grows with the length is paid by every stream of a long generation, on the
API process's cores.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.output_processor import RequestState  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402
from protocol.messages import TokenUpdate  # noqa: E402
from protocol.sampling import SamplingParams  # noqa: E402

TEXT = "The history of the city is long and full of stories about the people who lived there. "


def fold(tokenizer: Tokenizer, token_ids: list[int], length: int) -> tuple[float, float]:
    """Microseconds per token over the whole output, and over its last 128 tokens."""
    params = SamplingParams(max_tokens=length, temperature=0, stop=["never here"])
    state = RequestState("r", token_ids[:16], params, tokenizer)
    updates = [TokenUpdate("r", i, [token_ids[i % len(token_ids)]], [None]) for i in range(length)]
    started = time.perf_counter()
    for i, update in enumerate(updates):
        if i == length - 128:
            tail_started = time.perf_counter()
        state.apply(update)
    ended = time.perf_counter()
    return 1e6 * (ended - started) / length, 1e6 * (ended - tail_started) / 128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_model = Path.home() / ".cache/tandem/models/SmolLM2-135M-Instruct"
    parser.add_argument("--model", type=Path, default=default_model)
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 2048, 8192, 16384])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    tokenizer = Tokenizer(args.model)
    token_ids = tokenizer.encode(TEXT * 200)
    rows = []
    print(f"{'tokens':>7} | {'us/token, all':>13} | {'us/token, last 128':>18}")
    for length in args.lengths:
        mean, tail = fold(tokenizer, token_ids, max(length, 128))
        rows.append({"tokens": length, "us_per_token": mean, "us_per_token_last_128": tail})
        print(f"{length:>7} | {mean:>13.1f} | {tail:>18.1f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
