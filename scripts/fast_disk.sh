#!/usr/bin/env bash
# A disk faster than this VM's, for the loader benchmark's CPU-bound case (docs/performance.md, #30):
# an ext4 filesystem on a loop device whose backing file lives in memory (tmpfs). O_DIRECT works on
# it and the page cache can be dropped as on a real disk; a read costs a memory copy done by the
# kernel's loop thread on the same cores (more CPU per byte than an NVMe's DMA: a harsher case), 4-7 GB/s here.
# Needs root (losetup, mount). Usage:
#   sudo scripts/fast_disk.sh up /mnt/fast 3500M    # then: BENCH_DIR=/mnt/fast python scripts/bench_loader.py
#   (the synthetic model, its sha256 and its blake3 build: about 3 GB; this much memory is held until down)
#   sudo scripts/fast_disk.sh down /mnt/fast
set -euo pipefail
cmd=${1:?up|down}; mnt=${2:-/mnt/fast}; size=${3:-3500M}
img=/dev/shm/shardc-fast-disk.img
case "$cmd" in
  up)
    mkdir -p "$mnt"
    truncate -s "$size" "$img"
    dev=$(losetup -f --show "$img")
    mkfs.ext4 -q "$dev"
    mount "$dev" "$mnt"
    chmod 1777 "$mnt"
    echo "$mnt: ext4 on $dev (backed by $img, in memory)";;
  down)
    dev=$(findmnt -n -o SOURCE "$mnt")
    umount "$mnt"
    losetup -d "$dev"
    rm -f "$img";;
  *) echo "usage: $0 up|down [mountpoint] [size]" >&2; exit 2;;
esac
