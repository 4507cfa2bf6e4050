"""Plot busbw against message size from the JSON files of ``giftcomm.perf allreduce --json``.

``python -m studies plot A.json B.json ... -o busbw.png``: one panel per file (its title
is the file's ``--label`` or name), one line per format plus the MPI fp32 baseline.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def load_rows(path: str) -> tuple[str, dict]:
    data = json.loads(Path(path).read_text())
    return data.get("label") or Path(path).stem, data


def _series(row: dict) -> str:
    """The line a sweep row belongs to: a baseline (MPI_Allreduce fp32 or bf16, giftcomm's bf16
    ring baseline) or a giftcomm format."""
    if row["fmt"] in ("mpi", "mpibf"):
        return "MPI_Allreduce " + ("fp32" if row["fmt"] == "mpi" else "bf16")
    return f"giftcomm {row['fmt']}" + (" ring (baseline)" if str(row["algorithm"]).endswith("(baseline)") else "")


def plot(files: list[str], out: str) -> None:
    from studies.plotting import pyplot, save

    plt = pyplot()

    fig, axes = plt.subplots(1, len(files), figsize=(5.5 * len(files), 4.2), squeeze=False)
    for ax, path in zip(axes[0], files):
        label, data = load_rows(path)
        names = sorted({_series(r) for r in data["rows"]}, key=lambda n: (n.startswith(("MPI", "giftcomm bf16 ring (")), n))
        for name in names:
            rows = sorted((r for r in data["rows"] if _series(r) == name), key=lambda r: r["size"])
            ax.plot([r["size"] for r in rows], [r["busbw"] for r in rows], marker="o",
                    linestyle="--" if name.startswith("MPI") or "baseline" in name else "-", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (bytes of float32 input)")
        ax.set_ylabel("busbw (GB/s of float32 input)")
        ax.set_title(label if f"P={data['P']}" in label else f"{label} (P={data['P']})")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    save(fig, out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m studies plot", description=__doc__)
    ap.add_argument("files", nargs="+", help="JSON files from giftcomm.perf allreduce --json")
    ap.add_argument("-o", "--out", required=True, help="PNG file to write")
    args = ap.parse_args(argv)
    plot(args.files, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
