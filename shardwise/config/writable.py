"""Where a run will write, checked before launch: a folder this process can create files in,
on a disk with room, names within the file system's limits, a picture name matplotlib can save
(``logging.out_dir``, ``logging.schedule_png``, ``data.token_cache``, ``train.checkpoint_dir``).
Each check raises :class:`~shardwise.config.ConfigError` naming the field, the value and the fix.
"""
from __future__ import annotations

import os

from shardwise.config import ConfigError


# what matplotlib's savefig writes, by the picture's file suffix (none: PNG)
PICTURE_SUFFIXES = ("", ".png", ".svg", ".svgz", ".pdf", ".jpg", ".jpeg", ".tif", ".tiff",
                    ".webp", ".eps", ".ps", ".pgf", ".raw", ".rgba")


def check_picture(png: str) -> None:
    """logging.schedule_png: a file name savefig can write, in a folder that can be written."""
    if not png or png == "off":
        return
    field = "logging.schedule_png"
    suffix = os.path.splitext(png)[1].lower()
    if os.path.isdir(png) or png.endswith(os.sep):
        raise ConfigError(field, png, "is a directory, not a file name",
                          "give a file name such as runs/schedule.png")
    if suffix not in PICTURE_SUFFIXES:
        raise ConfigError(field, png, f"{suffix} is not a picture format",
                          "end the name with .png (or .svg, .pdf)")
    check_writable(os.path.dirname(os.path.abspath(png)), field, png)
    check_name_lengths(os.path.abspath(png), field, png)


def check_name_lengths(path: str, field: str, shown: str) -> None:
    """Every part of a path within the file system's limits (255 bytes a name on Linux)."""
    for part in path.split(os.sep):
        if len(os.fsencode(part)) > NAME_MAX:
            raise ConfigError(field, shown if len(shown) <= 60 else shown[:57] + "...",
                              f"a name in it is {len(os.fsencode(part))} bytes long, more than the "
                              f"{NAME_MAX} a file name may have", "use shorter names")
    if len(os.fsencode(path)) > PATH_MAX:
        raise ConfigError(field, shown[:57] + "...", f"longer than {PATH_MAX} bytes",
                          "use a shorter path")


NAME_MAX = 255
PATH_MAX = 3900           # 4096, less room for the run's own name and files


def check_writable(path: str, field: str = "logging.out_dir", shown: str | None = None) -> None:
    """out_dir, or the nearest folder above it that exists, must be a folder this process can
    create files in: tried with a temporary file (removed at once), so that root in a
    read-only folder (os.access says yes), /proc or a read-only mount are caught here too."""
    import tempfile
    shown = shown or path
    probe = os.path.abspath(path)
    if field == "logging.out_dir":
        check_name_lengths(probe, field, shown)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise ConfigError(field, shown, f"cannot be written here ({probe} is a file)",
                          "give a directory you can write to")
    try:
        with tempfile.TemporaryFile(dir=probe, prefix=".shardwise-probe-"):
            pass
        disk = os.statvfs(probe)
    except OSError as exc:
        raise ConfigError(field, shown, f"cannot be written here (no file can be made in {probe}:"
                          f" {exc.strerror or exc})", "give a directory you can write to") from None
    free = disk.f_bavail * disk.f_frsize
    if free < MIN_FREE_BYTES:
        raise ConfigError(field, shown, f"the disk holding {probe} is full ({free // 1024} KiB "
                          "free)", "free some space, or give a directory on another disk")


MIN_FREE_BYTES = 1 << 20   # a run's config, metrics and summary need some room: 1 MiB at least
