"""`python -m paratrain.docs_check`: the pages' blocks listed, or run one by one with a line each
and a summary; exit status 1 when any failed."""

from __future__ import annotations

import argparse
import re
import tempfile
import time
from pathlib import Path

import paratrain.docs_check as package
from paratrain.docs_check.pages import DEFAULT_TIMEOUT_S, Block, default_pages, read_page
from paratrain.docs_check.run import Result, run_block


def describe(block: Block) -> str:
    notes = [f"skip: {block.skip}" if block.skip else "", f"timeout {block.timeout_s:g}"
             if block.timeout_s != DEFAULT_TIMEOUT_S else "", f"file {block.save_as}" if block.save_as else "",
             f"in {block.folder}" if block.folder else "", "output shown" if block.shown else ""]
    head = f"{block.where} {block.lang}" + "".join(f" [{note}]" for note in notes if note)
    body = [f"    $ {c.text.splitlines()[0]}" for c in block.commands] or [f"    {block.body.splitlines()[0]}"]
    return "\n".join([head, *body])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m paratrain.docs_check", description=package.__doc__.split("\n\n")[0])
    parser.add_argument("pages", nargs="*", type=Path, help="markdown pages (default: README.md, docs/*.md "
                        "but the generated pages, examples/**/README.md)")
    parser.add_argument("--list", action="store_true", help="list the blocks and their annotations; run nothing")
    parser.add_argument("--only", metavar="PATTERN", help="run only blocks whose FILE:LINE or text matches "
                        "this regular expression")
    args = parser.parse_args(argv)
    blocks = [block for page in (args.pages or default_pages()) for block in read_page(page)]
    if args.only:
        blocks = [b for b in blocks if re.search(args.only, b.where) or re.search(args.only, b.body)]
    if args.list:
        print("\n".join(describe(block) for block in blocks))
        return 0
    start, results = time.monotonic(), []
    with tempfile.TemporaryDirectory(prefix="docs-check-cache-") as cache:
        for block in blocks:
            result = run_block(block, Path(cache))
            results.append(result)
            detail = f"({result.why})" if result.status == "skipped" else f"{result.seconds:.1f} s"
            print(f"{block.where} {result.status} {detail}", flush=True)
            if result.status == "FAIL":
                print("  " + result.why.replace("\n", "\n  "), flush=True)
    print(summary(results, time.monotonic() - start))
    return 1 if any(r.status == "FAIL" for r in results) else 0


def summary(results: list[Result], seconds: float) -> str:
    count = {status: [r for r in results if r.status == status] for status in ("PASS", "FAIL", "skipped")}
    ran = len(count["PASS"]) + len(count["FAIL"])
    lines = [f"docs-check: {ran} run, {len(count['PASS'])} passed, {len(count['FAIL'])} failed, "
             f"{len(count['skipped'])} skipped, in {seconds:.0f} s"]
    lines += [f"  FAIL {r.block.where}" for r in count["FAIL"]]
    lines += [f"  skipped {r.block.where}: {r.why}" for r in count["skipped"]]
    return "\n".join(lines)

