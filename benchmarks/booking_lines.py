"""How much of each stage is budget bookkeeping: code lines that name the budget's API.

    python benchmarks/booking_lines.py OLD_SRC NEW_SRC

Counts, per stage module, the code lines (not comments or docstrings) holding a
name of the budget's vocabulary (accounts, buffers, the in-flight ledger, their
bookings and verbs), and the modules outside ``memory/`` that import
``headrace._memory.budget``. A measure of where the booking rules live (issue 23:
"the bookkeeping that is left in the stages is the stage's own logic"), crude
by design: the same rule on both trees.
"""

from __future__ import annotations

import argparse
import io
import os
import re
import tokenize

#: Stage modules; "a|b" where the stage moved (a: its old path, b: its new ones, joined by +).
STAGES = [
    "transforms/map.py", "transforms/process_map.py", "transforms/shuffle.py",
    "transforms/prefetch.py", "transforms/batch.py", "transforms/padded_batch.py",
    "transforms/interleave.py|transforms/interleave.py+transforms/_interleave_cycle.py",
    "transforms/process_interleave.py", "transforms/unbatch.py",
    "transforms/cache.py|persist/cache.py+persist/memory_store.py",
    "sources/files.py", "sources/tfrecord.py", "adapters/torch.py", "adapters/jax.py",
]

VOCABULARY = {
    "account", "accounts", "buffer", "ledger", "Reservation", "Overdraft", "Ticket",
    "reservation", "reservations", "booking", "bookings", "booked", "overdraft",
    "charge", "hold", "require", "fits", "wait_for_room", "book_existing",
    "book_existing_total", "overdraw", "charge_chunk", "move_to", "absorb", "admit",
    "admit_existing", "admit_chunk", "enter", "room", "held", "limit", "StageAccount",
    "Buffer", "InFlight", "Assembly",
}


def booking_lines(path: str) -> tuple[int, int]:
    """(lines naming the vocabulary, code lines) of one module."""
    with open(path, encoding="utf-8") as handle:
        source = handle.read()
    naming: set[int] = set()
    code: set[int] = set()
    previous = tokenize.INDENT
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        kind = token.type
        if kind == tokenize.STRING and previous in (tokenize.INDENT, tokenize.NEWLINE,
                                                    tokenize.DEDENT):
            previous = kind
            continue  # a docstring
        if kind in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                    tokenize.DEDENT, tokenize.ENDMARKER):
            if kind == tokenize.NEWLINE:
                previous = kind
            continue
        code.add(token.start[0])
        if kind == tokenize.NAME and token.string in VOCABULARY:
            naming.add(token.start[0])
        previous = kind
    return len(naming), len(code)


def budget_importers(src: str) -> list[str]:
    found = []
    root = os.path.join(src, "headrace")
    for folder, _, files in os.walk(root):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            relative = os.path.relpath(path, root)
            if relative.startswith("memory" + os.sep):
                continue
            with open(path, encoding="utf-8") as handle:
                if re.search(r"headrace\.memory\.budget\b|from headrace\.memory import budget",
                             handle.read()):
                    found.append(relative)
    return sorted(found)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("old")
    parser.add_argument("new")
    args = parser.parse_args()
    print("| stage module | before: booking / code lines | after: booking / code lines |")
    print("|---|---|---|")
    for stage in STAGES:
        old_paths, _, new_paths = stage.partition("|")
        cells = []
        for src, paths in ((args.old, old_paths), (args.new, new_paths or old_paths)):
            found = [os.path.join(src, "headrace", path) for path in paths.split("+")]
            found = [path for path in found if os.path.exists(path)]
            counts = [booking_lines(path) for path in found]
            cells.append(f"{sum(n for n, _ in counts)} / {sum(c for _, c in counts)}"
                         if counts else "-")
        print(f"| {stage.replace('|', ' -> ')} | {cells[0]} | {cells[1]} |")
    old, new = budget_importers(args.old), budget_importers(args.new)
    print(f"\nmodules outside memory/ importing headrace._memory.budget: "
          f"before {len(old)}, after {len(new)}")
    print("after: " + ", ".join(new))


if __name__ == "__main__":
    main()
