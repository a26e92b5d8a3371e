"""CPU time per generated token of the streaming detokenizer, this tree against another's.

Usage: ``python bench/detokenizer_cpu.py [--old-tree .basetree] [--tokens 2000] [--repeats 15]``.
Loads ``engine/frontend/detokenizer.py`` of both trees into one process, feeds both the same
ids (README text encoded by the embedded Qwen3 tokenizer, one id per step after a 20-token
prompt, as the server feeds a request) without and with two stop strings, alternating, and
prints the median and minimum microseconds per token of each.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from engine.frontend.tokenizer import Tokenizer  # noqa: E402
from engine.loader.embedded import ensure_embedded_checkpoint  # noqa: E402


def load_detokenizer(tree: Path, name: str):
    """``IncrementalDetokenizer`` of ``tree``'s ``engine/frontend/detokenizer.py``."""
    spec = importlib.util.spec_from_file_location(name, tree / "engine/frontend/detokenizer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.IncrementalDetokenizer


def main() -> None:
    """Print one line per (tree, number of stop strings): median and min us per token."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old-tree", default=str(REPO / ".basetree"))
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    trees = {
        "old": load_detokenizer(Path(args.old_tree), "old"),
        "new": load_detokenizer(REPO, "new"),
    }
    tok = Tokenizer(ensure_embedded_checkpoint())
    text = (REPO / "README.md").read_text()
    ids = tok.encode(text * (1 + 4 * args.tokens // max(1, len(text))))[: args.tokens + 20]
    prompt, out = ids[:20], ids[20:]
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.repeats):
        for stops in ([], ["</answer>", "\n\nUser:"]):
            for name, cls in trees.items():
                detok = cls(tok, prompt, stop=stops)
                t0 = time.perf_counter()
                for token in out:
                    detok.step([token])
                detok.finish()
                us = (time.perf_counter() - t0) / len(out) * 1e6
                times.setdefault((name, len(stops)), []).append(us)
    for (name, n_stops), v in sorted(times.items()):
        print(f"{name} tree, {n_stops} stop strings: median {statistics.median(v):.1f} us/token, "
              f"min {min(v):.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
