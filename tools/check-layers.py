#!/usr/bin/python3
"""check-layers: fail on any #include that crosses the layering of docs/architecture.md.

The Makefile owns the table (LAYER_* and LAYERS) and passes it here, so the build's
include paths and this check cannot disagree:

  --folder DIR:LAYER   the files under DIR belong to LAYER (the longest DIR wins)
  --layer LAYER=D,D,.. the folders LAYER may include from (its own folder among them)

A quoted include is resolved as the compiler does (the including file's own folder first,
then the allowed folders); it is a violation when it resolves outside the allowed folders,
or only resolves in a folder of the tree that the layer may not use. System headers that
belong to one layer (ZeroMQ to the transport and above, libevent and SQLite to the gateway)
are checked by the table SYSTEM below. Exit status 0 when clean, 1 with one line per
violation, 2 on bad arguments.

  tools/check-layers.py [--root DIR] --folder ... --layer ...   (make check-layers)
"""
import argparse
import os
import re
import sys

# system header (prefix) -> layers that may include it. Others are free for everyone.
SYSTEM = {
    "zmq.h": {"transport", "kvtransfer", "worker", "prefill_worker", "decode_worker",
              "gateway", "tools", "tests"},
    "event2/": {"gateway", "bench", "tools", "tests"},
    "sqlite3.h": {"gateway", "tools", "tests"},
    "sodium.h": {"gateway", "tools", "tests"},
    "jansson.h": {"gateway", "trace", "bench", "sim", "tools", "tests"},
}

INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]')


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default=".", help="tree to check (default: .)")
    ap.add_argument("--folder", action="append", default=[], metavar="DIR:LAYER")
    ap.add_argument("--layer", action="append", default=[], metavar="LAYER=D,D")
    a = ap.parse_args(argv)
    folders, layers = {}, {}
    for f in a.folder:
        d, sep, layer = f.partition(":")
        if not sep or not d or not layer:
            ap.error("bad --folder %r" % f)
        folders[d.rstrip("/")] = layer
    for spec in a.layer:
        layer, sep, dirs = spec.partition("=")
        if not sep or not layer:
            ap.error("bad --layer %r" % spec)
        layers[layer] = [d.rstrip("/") for d in dirs.split(",") if d]
    for d, layer in folders.items():
        if layer not in layers:
            ap.error("folder %s names layer %s, which no --layer defines" % (d, layer))
    if not folders:
        ap.error("no --folder given (run it through `make check-layers`)")
    return a.root, folders, layers


def layer_of(path, folders):
    """The layer of a file at path (relative to the root), or None (not in a layer)."""
    best = None
    for d in folders:
        if path.startswith(d + "/") and (best is None or len(d) > len(best)):
            best = d
    return folders[best] if best else None


def check(root, folders, layers):
    root = os.path.abspath(root)
    all_dirs = sorted({d for ds in layers.values() for d in ds} | set(folders))
    problems, seen = [], set()
    for d in sorted(folders):
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, d)):
            dirnames[:] = sorted(x for x in dirnames if not x.startswith("."))
            for name in sorted(filenames):
                rel = os.path.relpath(os.path.join(dirpath, name), root)
                if not name.endswith((".c", ".h")) or rel in seen:
                    continue
                seen.add(rel)
                layer = layer_of(rel, folders)
                problems += check_file(root, rel, layer, layers[layer], all_dirs)
    return len(seen), problems


def check_file(root, rel, layer, allowed, all_dirs):
    out = []
    here = os.path.dirname(rel)
    with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            m = INCLUDE.match(line)
            if not m:
                continue
            kind, name = m.groups()
            where = "%s:%d" % (rel, lineno)
            if kind == "<":
                for prefix, owners in SYSTEM.items():
                    if (name == prefix or (prefix.endswith("/") and name.startswith(prefix))) \
                            and layer not in owners:
                        out.append("%s: <%s> belongs to %s; layer %s may not include it"
                                   % (where, name, "/".join(sorted(owners)), layer))
                continue
            found = None
            for d in [here] + allowed:
                p = os.path.normpath(os.path.join(d, name))
                if os.path.isfile(os.path.join(root, p)):
                    found = p
                    break
            if found is not None:
                fdir = os.path.dirname(found)
                if fdir != here and fdir not in allowed:
                    out.append('%s: "%s" is %s, outside what layer %s may include (%s)'
                               % (where, name, found, layer, ", ".join(allowed)))
                continue
            elsewhere = [os.path.join(d, name) for d in all_dirs
                         if os.path.isfile(os.path.join(root, d, name))]
            if elsewhere:
                out.append('%s: "%s" is %s, outside what layer %s may include (%s)'
                           % (where, name, elsewhere[0], layer, ", ".join(allowed)))
            else:
                out.append('%s: "%s" not found in the folders layer %s may include'
                           % (where, name, layer))
    return out


def main(argv):
    root, folders, layers = parse_args(argv)
    n_files, problems = check(root, folders, layers)
    for p in problems:
        print(p)
    if problems:
        print("check-layers: %d forbidden includes in %d files (table: Makefile LAYER_*, "
              "docs/architecture.md)" % (len(problems), n_files))
        return 1
    print("check-layers: %d files, every include within its layer" % n_files)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
