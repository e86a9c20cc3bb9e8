#!/bin/sh
# make base-image: a Python base image from Debian's archive (debootstrap minbase -> import -> python3), for sites
# where the upstream base cannot be pulled. Prints nothing but progress; writes the digest-pinned reference of the
# result to $OUT_REF, which `make image` builds FROM.
# Usage: base-image.sh ENGINE "BUILD_FLAGS" OUT_REF [SUITE] [MIRROR]
set -eu
engine=$1
flags=$2
out_ref=$3
suite=${4:-bookworm}
mirror=${5:-}
rootfs_image=localhost/sdserve-debian-min:$suite
base_image=localhost/sdserve-python:3-$suite
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

command -v debootstrap >/dev/null || { echo "base-image needs debootstrap (apt-get install debootstrap)" >&2; exit 1; }
echo "debootstrap --variant=minbase $suite (about a minute)"
# shellcheck disable=SC2086  # $mirror is empty (debootstrap's default) or one URL
debootstrap --variant=minbase "$suite" "$work/rootfs" $mirror >"$work/debootstrap.log" 2>&1 \
  || { tail -n 20 "$work/debootstrap.log" >&2; exit 1; }
rm -rf "$work/rootfs/var/cache/apt/archives/"*.deb "$work/rootfs/var/lib/apt/lists/"*
echo "importing the rootfs as $rootfs_image"
tar -C "$work/rootfs" -c . | "$engine" import - "$rootfs_image" >/dev/null
echo "adding python3 -> $base_image"
# shellcheck disable=SC2086  # the build flags are a word list by design
"$engine" build $flags --build-arg "ROOTFS_IMAGE=$rootfs_image" -t "$base_image" \
  -f "$(dirname "$0")/base.Containerfile" "$(dirname "$0")" >"$work/build.log" 2>&1 \
  || { tail -n 30 "$work/build.log" >&2; exit 1; }
digest=$("$engine" image inspect --format '{{.Digest}}' "$base_image")
mkdir -p "$(dirname "$out_ref")"
echo "${base_image%:*}@$digest" >"$out_ref"
echo "base image: $(cat "$out_ref")"
