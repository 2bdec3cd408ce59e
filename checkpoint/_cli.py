"""``python -m checkpoint`` / ``shardkit-checkpoint``: inspect, verify, consolidate and convert checkpoints.

Exit status: 0 on success, 1 when the checkpoint is invalid or cannot be read (the error
message, naming the file and the tensor, goes to stderr), 2 for a usage error.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import shutil
import signal
import sys
import textwrap
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TextIO

from ._consolidate import consolidate_files, parse_size
from ._convert import convert_to
from ._export import manager_step
from ._schema import CHECKSUMMED_VERSION, CheckpointError, CheckpointMetadata, TensorEntry
from ._sources import open_source

__all__ = ["main", "verify", "tensor_layout"]

PROG = "shardkit-checkpoint"

_DESCRIPTION = """\
Inspect, verify, consolidate and convert shardkit checkpoints (local folders or fsspec URLs such as
s3://bucket/ckpt; pass credentials or an endpoint with --storage-option)."""

_EPILOG = """\
examples:
  %(prog)s inspect ckpt
  %(prog)s verify s3://bucket/ckpt -o endpoint_url=http://127.0.0.1:9000
  %(prog)s consolidate ckpt model.safetensors
  %(prog)s consolidate ckpt hf-model --max-shard-size 5GB
  %(prog)s consolidate ckpt hf-model --max-shard-size 5GB --include model --strip-prefix model
  %(prog)s consolidate ckpts hf-model --include model --strip-prefix model --config pretrained
  %(prog)s convert --from dcp dcp-ckpt ckpt
  %(prog)s convert --from dcp --to safetensors dcp-ckpt model.safetensors
  %(prog)s convert --to dcp ckpt dcp-ckpt
  %(prog)s convert hf-model ckpt

exit status: 0 success, 1 invalid or unreadable checkpoint, 2 usage error."""


_STEP_HELP = ("PATH is a CheckpointManager's root: use step N (default: its latest committed step); its "
              "committed steps are listed")


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def _storage_option(text: str) -> tuple[list[str], Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key:
        msg = f"expected KEY=VALUE, got {text!r} (e.g. endpoint_url=http://127.0.0.1:9000)"
        raise argparse.ArgumentTypeError(msg)
    try:
        value = json.loads(raw)
    except ValueError:
        value = raw
    return key.split("."), value


def _size(text: str) -> int:
    try:
        return parse_size(int(text) if text.isdigit() else text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _options(pairs: Sequence[tuple[list[str], Any]] | None) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for path, value in pairs or ():
        where = options
        for part in path[:-1]:
            where = where.setdefault(part, {})
        where[path[-1]] = value
    return options


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=_DESCRIPTION, epilog=_EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-o", "--storage-option", dest="storage_options", action="append", type=_storage_option,
                        metavar="KEY=VALUE",
                        help="fsspec storage option for the checkpoint's file system, repeatable; VALUE is "
                             "parsed as JSON when it can be, dotted KEYs nest (client_kwargs.region_name=eu-west-1)")
    folder = argparse.ArgumentParser(add_help=False)
    folder.add_argument("path", metavar="PATH", help="checkpoint folder (local path or fsspec URL)")
    quiet = argparse.ArgumentParser(add_help=False)
    quiet.add_argument("-q", "--quiet", action="store_true",
                       help="no progress bar (also: environment SHARDKIT_QUIET=1)")

    inspect = commands.add_parser(
        "inspect", parents=[common, folder], help="list tensors, sizes, dtypes, layouts and values",
        description="List a checkpoint's tensors (dtype, shape, bytes, saved shards and how they split the tensor: "
                    "the split dimension and block sizes, or the grid of a mesh), its non-tensor values and "
                    "its data files, from the metadata alone (no tensor data is read).")
    inspect.add_argument("--json", action="store_true", help="print machine-readable JSON instead of a table")
    inspect.add_argument("--step", type=int, metavar="N", help=_STEP_HELP)

    verify = commands.add_parser(
        "verify", parents=[common, folder, quiet], help="re-read every byte: checksums, file sizes, headers",
        description="Re-read the whole checkpoint: validate the metadata, check that every data file exists with "
                    "the recorded size and a safetensors header matching the metadata, and check the checksum of "
                    "every saved region. Exits 1 and names the file and tensor of every problem found.")
    verify.add_argument("--step", type=int, metavar="N", help=_STEP_HELP)
    verify.add_argument("--strict", action="store_true",
                        help="also refuse a checkpoint whose metadata carries no checksum of its own content "
                             "(format versions 1 to 3, which nothing guards against edits)")

    cons = commands.add_parser(
        "consolidate", parents=[common, folder, quiet],
        help="write one .safetensors file or a Hugging Face style folder",
        description="Assemble the full tensors into one .safetensors file (OUTPUT is the file), or with "
                    "--max-shard-size into a Hugging Face style folder (OUTPUT is the folder: "
                    "model-0000k-of-0000N.safetensors plus model.safetensors.index.json). Streams one tensor at a "
                    "time and verifies every checksum; non-tensor values are kept as JSON under "
                    "'shardkit.values' (safetensors __metadata__, or the index's metadata).")
    cons.add_argument("output", metavar="OUTPUT", help="output file, or folder with --max-shard-size")
    cons.add_argument("--max-shard-size", type=_size, metavar="SIZE",
                      help="largest output file: bytes, or 5GB / 500MB (powers of 1000) / 2GiB (powers of 1024)")
    cons.add_argument("--include", action="append", metavar="PREFIX",
                      help="export only the entries under this dotted name prefix (whole components: 'model' "
                           "selects model.* but not model_ema.*), repeatable")
    cons.add_argument("--strip-prefix", metavar="PREFIX",
                      help="remove this prefix from the exported names, e.g. 'model' turns model.fc.weight "
                           "into fc.weight (for load_state_dict or from_pretrained)")
    cons.add_argument("--config", metavar="FOLDER",
                      help="copy config.json (and generation_config.json) from this pretrained folder into OUTPUT, "
                           "which becomes a folder from_pretrained loads")
    cons.add_argument("--step", type=int, metavar="N",
                      help="CKPT is a CheckpointManager's root: export step N (default: its latest committed step)")
    conv = commands.add_parser(
        "convert", parents=[common],
        help="convert between shardkit checkpoints and torch.distributed.checkpoint (DCP) folders",
        description="Convert a DCP folder (written by torch.distributed.checkpoint.save) into a shardkit checkpoint "
                    "or one .safetensors file, a Hugging Face checkpoint into a shardkit checkpoint or a DCP "
                    "folder, or a shardkit checkpoint into a DCP folder that dcp.load reads. The defaults are "
                    "checkpoint.convert's: SRC's format is inferred (shardkit or Hugging Face; never DCP), and "
                    "DST is a DCP folder for a shardkit SRC, a shardkit checkpoint otherwise. "
                    "Runs in one process; the whole checkpoint passes through memory once. A folder is read as DCP "
                    "only with --from dcp: DCP's .metadata file is a pickle, read with a restricted unpickler "
                    "that admits DCP's own metadata classes only and refuses any other global before calling it. "
                    "shardkit's own format never uses pickle, and nothing else is ever unpickled.")
    conv.add_argument("path", metavar="SRC", help="source folder (a DCP folder must be local)")
    conv.add_argument("output", metavar="DST", help="destination folder, or .safetensors file with --to safetensors")
    conv.add_argument("--from", dest="from_format", choices=("shardkit", "huggingface", "dcp"), default=None,
                      help="format of SRC (default: inferred from its files, shardkit or huggingface; a DCP "
                           "folder must be named with --from dcp)")
    conv.add_argument("--to", dest="to_format", choices=("shardkit", "dcp", "safetensors"), default=None,
                      help="format of DST (default: dcp for a shardkit SRC, else shardkit)")
    return parser


def _quiet_on_closed_pipe(run: Callable[[Sequence[str] | None], int]) -> Callable[[Sequence[str] | None], int]:
    """End quietly when the reader of stdout goes away (``inspect ckpt | head``), as Unix tools do."""
    @functools.wraps(run)
    def wrapper(argv: Sequence[str] | None = None) -> int:
        try:
            status = run(argv)
            sys.stdout.flush()  # buffered output meets a closed pipe here, not at exit
        except BrokenPipeError:
            # Python would flush stdout again at exit and report the same error; send it nowhere.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
            return 128 + signal.SIGPIPE
        return status
    return wrapper


@_quiet_on_closed_pipe
def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    args = _parser().parse_args(argv)
    options = _options(args.storage_options)
    try:
        if args.command == "inspect":
            return _inspect(args.path, options, as_json=args.json, out=sys.stdout, step=args.step)
        if args.command == "verify":
            return _verify_cmd(args.path, options, quiet=args.quiet, out=sys.stdout, step=args.step,
                               strict=args.strict)
        if args.command == "convert":
            written = convert_to(args.path, args.output, from_format=args.from_format, to_format=args.to_format)
            print(f"wrote {args.output} ({written})", file=sys.stdout)
            return 0
        return _consolidate_cmd(args.path, args.output, args.max_shard_size, options, quiet=args.quiet,
                                include=args.include, strip_prefix=args.strip_prefix, out=sys.stdout,
                                config=args.config, step=args.step)
    except BrokenPipeError:
        raise  # not the checkpoint's fault: handled in _quiet_on_closed_pipe
    except (CheckpointError, OSError, ValueError) as exc:
        print(f"{PROG} {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG} {args.command}: interrupted", file=sys.stderr)
        return 130


# -- inspect ---------------------------------------------------------------------------------

def tensor_layout(entry: TensorEntry) -> dict[str, Any]:
    """How a tensor's saved regions split it, from the metadata alone. Pure.

    ``{"kind": "whole"}`` (one region), ``{"kind": "split", "dim": d, "sizes": [...]}``
    (blocks along one dimension, in order), ``{"kind": "grid", "dims": [...], "sizes":
    [[...], ...]}`` (a full grid of blocks over several dimensions, as a mesh spec saves
    them), or ``{"kind": "blocks", "count": n}`` for any other tiling.
    """
    regions = [s for s in entry.shards if s.numel > 0]
    size = tuple(entry.size)
    if len(regions) <= 1:
        return {"kind": "whole"}
    dims = [d for d in range(len(size)) if any(s.dims[d] != size[d] for s in regions)]
    cuts = [sorted({(s.offsets[d], s.dims[d]) for s in regions}) for d in dims]
    tiles = all(sum(n for _, n in c) == size[d] and all(a[0] + a[1] == b[0] for a, b in zip(c, c[1:]))
                for d, c in zip(dims, cuts))
    if not tiles or math.prod(len(c) for c in cuts) != len(regions):
        return {"kind": "blocks", "count": len(regions)}
    sizes = [[n for _, n in c] for c in cuts]
    if len(dims) == 1:
        return {"kind": "split", "dim": dims[0], "sizes": sizes[0]}
    return {"kind": "grid", "dims": dims, "sizes": sizes}


def _runs(sizes: Sequence[int]) -> str:
    """``[3, 3, 3, 1]`` -> ``"3, 3, 3, 1"``; long runs compressed: ``[16] * 63 + [8]`` -> ``"16 (x63), 8"``."""
    parts: list[str] = []
    k = 0
    while k < len(sizes):
        j = k
        while j < len(sizes) and sizes[j] == sizes[k]:
            j += 1
        parts.append(f"{sizes[k]} (x{j - k})" if j - k > 3 else ", ".join([str(sizes[k])] * (j - k)))
        k = j
    return ", ".join(parts)


def _layout_text(layout: Mapping[str, Any]) -> str:
    if layout["kind"] == "whole":
        return "whole"
    if layout["kind"] == "split":
        return f"dim {layout['dim']}: {_runs(layout['sizes'])}"
    if layout["kind"] == "grid":
        shape = "x".join(str(len(s)) for s in layout["sizes"])
        return f"grid {shape}: " + " x ".join(f"dim {d} [{_runs(s)}]" for d, s in zip(layout["dims"], layout["sizes"]))
    return f"{layout['count']} blocks"


def _describe(path: str, metadata: CheckpointMetadata, source_format: str = "shardkit") -> dict[str, Any]:
    return {
        "path": path, "format": source_format,
        "format_version": metadata.version if source_format == "shardkit" else None,
        "generation": metadata.generation,
        "saved_world_size": metadata.world_size,
        "tensors": {name: {"dtype": str(e.dtype).removeprefix("torch."), "shape": list(e.size), "bytes": e.nbytes,
                           "shards": len([s for s in e.shards if s.numel > 0]), "layout": tensor_layout(e)}
                    for name, e in metadata.tensors.items()},
        "values": dict(metadata.values),
        "files": dict(metadata.files),
        "tensor_bytes": metadata.nbytes,
        "file_bytes": sum(metadata.files.values()),
    }


def _steps_text(steps: Sequence[int]) -> str:
    """``[0, 10, 20]``; past 12 steps, the first and last five around the count of those left out."""
    if len(steps) <= 12:
        return ", ".join(map(str, steps))
    return f"{', '.join(map(str, steps[:5]))}, ... ({len(steps) - 10} more), {', '.join(map(str, steps[-5:]))}"


def _chosen(path: str, options: Mapping[str, Any], step: int | None, out: TextIO | None
            ) -> tuple[str, dict[str, Any] | None]:
    """The checkpoint folder to read: ``path`` itself, or a CheckpointManager root's step (listed on ``out``)."""
    found = manager_step(path, step, options)
    if found is None:
        return path, None
    folder, chosen, steps = found
    if out is not None:
        which = "latest" if step is None else "chosen with --step"
        print(f"CheckpointManager root {path}: {len(steps)} committed step{'s' if len(steps) != 1 else ''} "
              f"[{_steps_text(steps)}]; step {chosen} ({which}) follows.", file=out)
    return folder, {"root": path, "steps": steps, "step": chosen}


def _inspect(path: str, options: Mapping[str, Any], *, as_json: bool, out: TextIO, width: int | None = None,
             step: int | None = None) -> int:
    folder, manager = _chosen(path, options, step, None if as_json else out)
    with open_source(folder, storage_options=options) as source:
        info = _describe(folder, source.describe(), source.format)
    if as_json:
        if manager is not None:
            info["manager"] = manager
        print(json.dumps(info, indent=2), file=out)
        return 0
    path = folder
    width = width or shutil.get_terminal_size((100, 24)).columns
    tensors = info["tensors"]
    if info["format"] == "shardkit":
        print(f"checkpoint {path}  (format v{info['format_version']}, generation {info['generation']}, "
              f"saved by {info['saved_world_size']} rank{'s' if info['saved_world_size'] != 1 else ''})", file=out)
    else:
        print(f"checkpoint {path}  (Hugging Face safetensors, no checksums)", file=out)
    rows = [("name", "dtype", "shape", "bytes", "shards", "layout")]
    rows += [(name, t["dtype"], str(tuple(t["shape"])), _human(t["bytes"]), str(t["shards"]),
              _layout_text(t["layout"])) for name, t in tensors.items()]
    widths = [max(len(r[c]) for r in rows) for c in range(5)]
    indent = sum(widths) + 2 * 5
    # The layout column wraps within the terminal (at least 20 columns of it), under itself.
    room = max(20, width - indent)
    print(file=out)
    for k, row in enumerate(rows):
        cells = [row[c].ljust(widths[c]) if c in (0, 1, 2) else row[c].rjust(widths[c]) for c in range(5)]
        # "16 (x62)" is one word: wrap between blocks, never inside one.
        lines = [line.replace("\0", " ") for line in textwrap.wrap(
            row[5].replace(" (x", "\0(x"), room, break_long_words=False, break_on_hyphens=False)] or [""]
        print(("  ".join(cells) + "  " + lines[0]).rstrip(), file=out)
        for line in lines[1:]:
            print(" " * indent + line, file=out)
        if k == 0:
            print("  ".join("-" * w for w in [*widths, min(room, max(len(r[5]) for r in rows))]), file=out)
    if info["values"]:
        print(f"\nvalues ({len(info['values'])}):", file=out)
        for name, value in info["values"].items():
            head = f"  {name} = "
            text = json.dumps(value)
            lines = textwrap.wrap(text, max(30, width - len(head)), break_long_words=True, break_on_hyphens=False)
            print(head + (lines[0] if lines else text), file=out)
            for line in lines[1:]:
                print(" " * len(head) + line, file=out)
    print(f"\n{len(tensors)} tensors, {info['tensor_bytes']} bytes ({_human(info['tensor_bytes'])}) of tensor data; "
          f"{len(info['files'])} data files, {info['file_bytes']} bytes ({_human(info['file_bytes'])})", file=out)
    return 0


# -- verify ------------------------------------------------------------------------------------

def verify(path: str, *, storage_options: Mapping[str, Any] | None = None, quiet: bool | None = None,
           strict: bool = False) -> tuple[CheckpointMetadata, list[str]]:
    """Re-read a whole checkpoint; return its metadata and every problem found (empty if valid).

    A shardkit checkpoint (every data file's size and header, every chunk checksum) or a
    Hugging Face one (headers and sizes: its files carry no checksums), told apart by their
    files like ``load`` does; never a DCP folder (its metadata is a pickle).

    Raises ``CheckpointError`` only when the metadata itself is missing or malformed (nothing
    else can be checked then). Each problem is a ``CheckpointError`` message naming the file
    and, where one is involved, the tensor.

    With ``strict``, a checkpoint whose metadata nothing guards against edits is a problem too:
    a shardkit format version without the content checksum (1 to 3), or a Hugging Face
    checkpoint (no checksums at all).
    """
    with open_source(path, storage_options=storage_options) as source:
        metadata, problems = source.describe(), source.verify(quiet=quiet)
        unguarded = source.format != "shardkit" or metadata.version < CHECKSUMMED_VERSION
        if strict and unguarded:
            what = (f"format version {metadata.version} records no checksum of its metadata's own content (from "
                    f"version {CHECKSUMMED_VERSION} on it does)" if source.format == "shardkit"
                    else f"a {source.format} checkpoint carries no checksums")
            problems.append(f"{path}: {what}, so an edited file cannot be told from the saved one; strict "
                            f"verification refuses it. Load it and save it again with this shardkit to get a "
                            f"checksummed checkpoint.")
    return metadata, problems


def _verify_cmd(path: str, options: Mapping[str, Any], *, quiet: bool, out: TextIO, step: int | None = None,
                strict: bool = False) -> int:
    path = _chosen(path, options, step, out)[0]
    metadata, problems = verify(path, storage_options=options, quiet=True if quiet else None, strict=strict)
    if problems:
        for problem in problems:
            print(f"{PROG} verify: error: {problem}", file=sys.stderr)
        print(f"{PROG} verify: {path}: INVALID, {len(problems)} problem{'s' if len(problems) != 1 else ''} found.",
              file=sys.stderr)
        return 1
    regions = sum(1 for e in metadata.tensors.values() for s in e.shards if s.numel > 0)
    print(f"{path}: OK: {len(metadata.tensors)} tensors, {regions} saved regions, {len(metadata.files)} data files, "
          f"{metadata.nbytes} bytes ({_human(metadata.nbytes)}) verified; {len(metadata.values)} values.", file=out)
    return 0


# -- consolidate -------------------------------------------------------------------------------

def _consolidate_cmd(path: str, output: str, max_shard_size: int | None, options: Mapping[str, Any], *,
                     quiet: bool, out: TextIO, include: Sequence[str] | None = None,
                     strip_prefix: str | None = None, config: str | None = None, step: int | None = None) -> int:
    files = consolidate_files(path, output, max_shard_size=max_shard_size, include=include,
                              strip_prefix=strip_prefix, config=config, step=step, storage_options=options,
                              quiet=True if quiet else None)
    for written in files:
        print(f"wrote {written}", file=out)
    return 0

