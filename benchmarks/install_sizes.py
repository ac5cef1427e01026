#!/usr/bin/env python3
"""What each extra of pyproject.toml downloads: packages, files and sizes.

    python benchmarks/install_sizes.py [--download-dir DIR] [--out FILE]
        [--extras mpi test ...] [--also cupy-cuda12x cupy-cuda13x]
        [--index-url URL] [--keep-pip-config] [--no-verify]

For the plain install and each extra, ``pip install --dry-run
--ignore-installed --report`` resolves [project] dependencies (and the
extra's requirements) to the releases the index offers today for this
Python and platform; every package the extra brings beyond the plain
install is then fetched with ``pip download --no-deps`` (a file already
under ``--download-dir``, anywhere below it, with the sha256 the report
names, is reused) and its size on disk counted.  ``--also`` measures other
requirements the same way (the prebuilt cupy wheels, by default).

A requirement the index has only as source and that pip cannot build here
(``cupy`` without a CUDA toolkit) stops pip's resolution: the table then
says so, names the newest source archive the index offers for it and its
size, and counts nothing of what its build would bring.

By default pip asks ``--index-url`` (PyPI) alone: pip's configuration
files, find-links and extra indexes are ignored (``PIP_CONFIG_FILE`` is set
to the null device), so that the sizes are those of the index.  Sizes are
MB of 10^6 bytes.  Writes a plain-text table headed by the command, date,
platform, Python and pip versions.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYPI = "https://pypi.org/simple"
#: the environment variables pip reads that say where it looks (dropped unless
#: --keep-pip-config)
WHERE = ("PIP_CONFIG_FILE", "PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL",
         "PIP_NO_INDEX", "PIP_CONSTRAINT", "PIP_REQUIREMENT", "PIP_PRE",
         "PIP_ONLY_BINARY", "PIP_NO_BINARY", "PIP_PREFER_BINARY")
#: a group of packages sharing a name's first part is totalled from this many on
GROUP = 3
SCRIPT = "benchmarks/install_sizes.py"
TIMEOUT = 1800


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def mb(size: int, decimals: int = 3) -> str:
    return f"{size / 1e6:.{decimals}f}"


def n_packages(n: int) -> str:
    return f"{n} package" + ("" if n == 1 else "s")


def say(*words) -> None:
    print(*words, file=sys.stderr, flush=True)


class Pip:
    """pip of this interpreter, asking one index (or pip's own configuration)."""

    def __init__(self, index_url: str, keep_config: bool):
        self.env = dict(os.environ)
        self.args = []
        if not keep_config:
            for name in WHERE:
                self.env.pop(name, None)
            self.env["PIP_CONFIG_FILE"] = os.devnull
            self.args = ["--index-url", index_url]
        self.env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"

    def run(self, *args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "pip", *args]
        if args[0] in ("install", "download"):
            command += self.args
        return subprocess.run(command, env=self.env, capture_output=True, text=True,
                              timeout=TIMEOUT)

    def version(self) -> str:
        return self.run("--version").stdout.split()[1]

    def resolve(self, requirements: list, *options: str):
        """(the report's install list, None), or (None, pip's error) where pip stops."""
        with tempfile.TemporaryDirectory() as scratch:
            report = Path(scratch) / "report.json"
            done = self.run("install", "--dry-run", "--ignore-installed", "--quiet",
                            "--report", str(report), *options, *requirements)
            if done.returncode != 0 or not report.exists():
                return None, done.stdout + done.stderr
            return json.loads(report.read_text())["install"], None


def why_pip_stopped(output: str) -> str:
    """The lines of pip's error output that say why (one line)."""
    lines = [line.strip() for line in output.splitlines()]
    said = [line for line in lines
            if (line.startswith(("ERROR:", "error:")) or re.match(r"\w*(Error|Exception): ", line))
            and "subprocess-exited-with-error" not in line]
    return " / ".join(dict.fromkeys(said)) or (lines[-1] if lines else "no output")


class Files:
    """The files under the download folder, found by name, sized, fetched."""

    def __init__(self, folder: Path, pip: Pip, verify: bool):
        self.folder, self.pip, self.verify = folder, pip, verify
        self.notes: list = []
        self.digests: dict = {}
        self._index()

    def _index(self) -> None:
        self.by_name: dict = {}
        for path in sorted(self.folder.rglob("*")):
            if path.is_file():
                self.by_name.setdefault(path.name, []).append(path)

    def _matching(self, filename: str, sha256: str | None):
        for path in self.by_name.get(filename, []):
            if not self.verify or not sha256:
                return path
            if path not in self.digests:
                digest = hashlib.sha256()
                with open(path, "rb") as f:
                    for block in iter(lambda: f.read(1 << 20), b""):
                        digest.update(block)
                self.digests[path] = digest.hexdigest()
            if self.digests[path] == sha256:
                return path
            self.notes.append(f"{path}: not the file the index names (sha256 differs); "
                              "fetched again")
        return None

    def wheel(self, label: str, item: dict) -> tuple:
        """(file name, size) of one package of a report, fetched unless found."""
        name, version = item["metadata"]["name"], item["metadata"]["version"]
        info = item["download_info"]
        filename = urllib.parse.unquote(info["url"].rsplit("/", 1)[1])
        sha256 = info.get("archive_info", {}).get("hashes", {}).get("sha256")
        path = self._matching(filename, sha256)
        if path is None:
            dest = self.folder / re.sub(r"[^\w.+-]+", "_", label)
            dest.mkdir(parents=True, exist_ok=True)
            say(f"   pip download --no-deps {name}=={version}")
            done = self.pip.run("download", "--no-deps", "--quiet", "--dest", str(dest),
                                f"{name}=={version}")
            if done.returncode != 0:
                raise SystemExit(f"pip download {name}=={version} failed: "
                                 f"{why_pip_stopped(done.stdout + done.stderr)}")
            self._index()
            path = self._matching(filename, None)
            if path is None:
                raise SystemExit(f"pip download {name}=={version} did not fetch {filename}")
        return filename, path.stat().st_size

    def url(self, label: str, filename: str, url: str, sha256: str | None) -> int:
        """Size of a file the index names (a source archive pip cannot fetch
        without building it), fetched from its address unless found."""
        path = self._matching(filename, sha256)
        if path is None:
            dest = self.folder / re.sub(r"[^\w.+-]+", "_", label)
            dest.mkdir(parents=True, exist_ok=True)
            say(f"   fetching {url}")
            path = dest / filename
            with urllib.request.urlopen(url, timeout=TIMEOUT) as answer, open(path, "wb") as f:
                for block in iter(lambda: answer.read(1 << 20), b""):
                    f.write(block)
            self._index()
        return path.stat().st_size


def newest_source(index_url: str, requirement: str):
    """(version, file name, address, sha256) of the newest source archive the
    index (its JSON API, PEP 691) offers for ``requirement``, or None."""
    try:
        from packaging.requirements import Requirement
        from packaging.specifiers import SpecifierSet
        from packaging.utils import parse_sdist_filename
        from packaging.version import Version
    except ImportError:  # (pip's own copy)
        from pip._vendor.packaging.requirements import Requirement
        from pip._vendor.packaging.specifiers import SpecifierSet
        from pip._vendor.packaging.utils import parse_sdist_filename
        from pip._vendor.packaging.version import Version
    wanted = Requirement(requirement)
    address = f"{index_url.rstrip('/')}/{canonical(wanted.name)}/"
    ask = urllib.request.Request(address,
                                 headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(ask, timeout=120) as answer:
        files = json.load(answer)["files"]
    python = Version(platform.python_version())
    found = []
    for f in files:
        if f.get("yanked") or not f["filename"].endswith((".tar.gz", ".zip")):
            continue
        try:
            version = parse_sdist_filename(f["filename"])[1]
        except Exception:  # (not a name pip would take either)
            continue
        if version.is_prerelease or version not in wanted.specifier:
            continue
        if f.get("requires-python") and python not in SpecifierSet(f["requires-python"]):
            continue
        found.append((version, f))
    if not found:
        return None
    version, f = max(found, key=lambda pair: pair[0])
    return (str(version), f["filename"], urllib.parse.urljoin(address, f["url"]),
            f.get("hashes", {}).get("sha256"))


def read_project() -> tuple:
    try:
        import tomllib
    except ImportError:  # (Python < 3.11)
        import tomli as tomllib
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return project, project.get("dependencies", []), project.get("optional-dependencies", {})


def measure(label: str, requirements: list, own: list, base: dict | None, pip: Pip,
            files: Files, index_url: str) -> dict:
    """One row: the packages ``requirements`` bring beyond ``base`` and their files."""
    say(f"{label}: pip install --dry-run {' '.join(requirements)}")
    items, error = pip.resolve(requirements)
    row = {"label": label, "requirements": own, "packages": [], "error": None, "source": []}
    if items is None:
        row["error"] = why_pip_stopped(error)
        # which of its own requirements has no wheel, and the source archive pip stopped on
        for requirement in own:
            wheels, _ = pip.resolve([requirement], "--no-deps", "--only-binary", ":all:")
            if wheels is not None:
                continue
            source = newest_source(index_url, requirement)
            if source is None:
                row["source"].append((requirement, None, None, None))
                continue
            version, filename, url, sha256 = source
            size = files.url(label, filename, url, sha256)
            row["source"].append((requirement, version, filename, size))
        return row
    for item in items:
        name, version = item["metadata"]["name"], item["metadata"]["version"]
        key = canonical(name)
        if base is not None and base.get(key) == version:
            continue
        filename, size = files.wheel(label, item)
        note = f"(replaces {base[key]})" if base and key in base else ""
        row["packages"].append((name, version, filename, size, note))
    return row


def table(rows: list, header: list, first_also: int) -> list:
    lines = list(header)
    lines += ["", "extra                     packages        bytes         MB  requirements"]
    distinct = {p[2]: p[3] for row in rows for p in row["packages"]}
    distinct.update({s[2]: s[3] for row in rows for s in row["source"] if s[2]})
    for k, row in enumerate(rows):
        if k == first_also:
            lines.append("not extras (--also): the same for each of these requirements instead")
        if row["error"] is None:
            count, size, note = len(row["packages"]), sum(p[3] for p in row["packages"]), ""
        else:
            count, size = len(row["source"]), sum(s[3] or 0 for s in row["source"])
            note = "  (not resolved: source only, see below)"
        lines.append(f"{row['label']:<24}{count:>8} {size:>12} {mb(size, 1):>10}  "
                     f"{' '.join(row['requirements'])}{note}")
    lines.append(f"all of them together: {len(distinct)} distinct files, "
                 f"{sum(distinct.values())} bytes, {mb(sum(distinct.values()), 1)} MB")
    for row in rows:
        lines += ["", f"{row['label']}: {' '.join(row['requirements']) or '-'}"]
        if row["error"] is not None:
            lines.append(f"  pip could not resolve it here: {row['error']}")
            for requirement, version, filename, size in row["source"]:
                if version is None:
                    lines.append(f"  {requirement}: no wheel and no source archive on the index")
                else:
                    lines.append(f"  {requirement}: no wheel for this platform on the index, "
                                 f"source only: {requirement} {version}, {filename}, "
                                 f"{size} bytes, {mb(size)} MB")
            lines.append("  what building and installing it would bring is not counted")
            continue
        lines.append(f"  {'package':<32}{'version':<16}{'bytes':>12}{'MB':>11}  file")
        for name, version, filename, size, note in sorted(row["packages"],
                                                          key=lambda p: canonical(p[0])):
            lines.append(f"  {name:<32}{version:<16}{size:>12}{mb(size):>11}  {filename}"
                         + (f"  {note}" if note else ""))
        groups: dict = {}
        for package in row["packages"]:
            groups.setdefault(canonical(package[0]).split("-")[0], []).append(package[3])
        for first, sizes in sorted(groups.items()):
            if len(sizes) >= GROUP:
                lines.append(f"  {first + '-*':<32}{n_packages(len(sizes)):<16}{sum(sizes):>12}"
                             f"{mb(sum(sizes), 1):>11}")
        size = sum(p[3] for p in row["packages"])
        lines.append(f"  {'total':<32}{n_packages(len(row['packages'])):<16}{size:>12}"
                     f"{mb(size, 1):>11}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--download-dir", type=Path, default=None,
                        help="where the files are downloaded, and files already there "
                             "reused (default: a temporary folder, removed at the end)")
    parser.add_argument("--out", type=Path, default=None,
                        help="the table's file (default: standard output)")
    parser.add_argument("--extras", nargs="*", default=None,
                        help="the extras measured (default: every extra of pyproject.toml)")
    parser.add_argument("--also", nargs="*", default=["cupy-cuda12x", "cupy-cuda13x"],
                        help="other requirements measured as an extra would be (default: "
                             "%(default)s, cupy's prebuilt wheels)")
    parser.add_argument("--index-url", default=PYPI, help="the index asked (default: PyPI)")
    parser.add_argument("--keep-pip-config", action="store_true",
                        help="let pip use its configuration files and PIP_* variables "
                             "(find-links, other indexes) instead of --index-url alone")
    parser.add_argument("--no-verify", action="store_true",
                        help="reuse a file found by name without checking its sha256")
    args = parser.parse_args()

    project, dependencies, extras = read_project()
    names = list(extras) if args.extras is None else args.extras
    unknown = sorted(set(names) - set(extras))
    if unknown:
        parser.error(f"no extra {unknown} in pyproject.toml (it has {sorted(extras)})")

    pip = Pip(args.index_url, args.keep_pip_config)
    scratch = None
    if args.download_dir is None:
        scratch = tempfile.TemporaryDirectory(prefix="install-sizes-")
        folder = Path(scratch.name)
    else:
        folder = args.download_dir
        folder.mkdir(parents=True, exist_ok=True)
    files = Files(folder, pip, not args.no_verify)
    try:
        rows = [measure("(none)", dependencies, dependencies, None, pip, files, args.index_url)]
        if rows[0]["error"] is not None:
            raise SystemExit(f"the plain install does not resolve: {rows[0]['error']}")
        base = {canonical(p[0]): p[1] for p in rows[0]["packages"]}
        for name in names:
            rows.append(measure(name, dependencies + extras[name], extras[name], base, pip,
                                files, args.index_url))
        for requirement in args.also:
            rows.append(measure(requirement, dependencies + [requirement], [requirement],
                                base, pip, files, args.index_url))
    finally:
        if scratch is not None:
            scratch.cleanup()

    libc = " ".join(filter(None, platform.libc_ver()))
    where = ("pip's configuration and PIP_* variables" if args.keep_pip_config else
             f"{args.index_url} alone (pip's configuration files, find-links and extra "
             "indexes ignored)")
    header = [
        "$ python " + shlex.join([SCRIPT, *sys.argv[1:]]),
        f"# date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
        f"# platform: {platform.platform()} ({platform.machine()}, {libc or 'libc unknown'})",
        f"# python: {platform.python_version()} ({platform.python_implementation()}), "
        f"pip {pip.version()}",
        f"# index: {where}",
        f"# project: {project['name']} {project.get('version', '')}, pyproject.toml",
        "# each row: the packages `pip install --dry-run --ignore-installed --report` resolves "
        "[project] dependencies and the extra's",
        "# requirements to, less those of the plain install `(none)` (same name and version); "
        "each file as `pip download --no-deps`",
        "# fetches it; MB are 10^6 bytes; a package two extras share is counted in each",
    ]
    lines = table(rows, header, 1 + len(names))
    if files.notes:
        lines += [""] + [f"# note: {note}" for note in dict.fromkeys(files.notes)]
    text = "\n".join(lines) + "\n"
    if args.out is None:
        sys.stdout.write(text)
    else:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        say(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
