#!/bin/bash
# Builds the guest: a Debian kernel (the host distribution's linux-image-amd64) and a busybox
# initramfs holding the virtio and vfio modules and the project's own /init (guest/init).
# usage: guest/mkguest.sh DIR      -> DIR/vmlinuz, DIR/initrd.cpio.gz   (about 5 s once downloaded)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd -P)
dir=${1:?usage: mkguest.sh DIR}
mkdir -p "$dir" && cd "$dir"
if [ ! -d kroot ]; then
  kpkg=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/{print $2; exit}')
  if [ -z "$kpkg" ]; then apt-get update -qq; kpkg=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-[0-9]/{print $2; exit}'); fi
  rm -rf dl && mkdir dl && (cd dl && apt-get download -qq -o Acquire::Retries=3 "$kpkg" busybox-static)
  dpkg-deb -x dl/linux-image-*.deb kroot.tmp && dpkg-deb -x dl/busybox-static_*.deb bb
  mv kroot.tmp kroot
fi
cp kroot/boot/vmlinuz-* vmlinuz
rm -rf initrd && mkdir -p initrd/{bin,lib/modules,proc,sys,dev,mnt,tmp}
cp bb/bin/busybox initrd/bin/busybox
# vfio*: the hostile-guest trial drives a device from user space through the guest IOMMU.
# virtio-rng: the rng trial (memvisor-vhost's example device).
mods="virtio_ring virtio virtio_pci_legacy_dev virtio_pci_modern_dev virtio_pci virtio_blk virtio_balloon
  irqbypass vfio vfio_iommu_type1 vfio_virqfd vfio-pci-core vfio-pci
  virtio-rng"
for m in $mods; do
  f=$(find kroot/lib/modules -name "$m.ko*" | head -1)
  [ -n "$f" ] || { echo "mkguest: module $m not in the kernel package" >&2; exit 1; }
  case $f in
    *.ko.xz) xz -dc "$f" > "initrd/lib/modules/$m.ko" ;;
    *.ko.zst) zstd -qdc "$f" > "initrd/lib/modules/$m.ko" ;;
    *) cp "$f" "initrd/lib/modules/$m.ko" ;;
  esac
done
echo $mods > initrd/modules
cp "$here/init" initrd/init && chmod +x initrd/init
# The project's guest programs, static.
for c in "$here"/progs/*.c; do gcc -O2 -static -o "initrd/bin/$(basename "$c" .c)" "$c"; done
(cd initrd && find . | ../bb/bin/busybox cpio -o -H newc 2>/dev/null | gzip -1) > initrd.cpio.gz
echo "guest: $(basename "$(ls kroot/boot/vmlinuz-*)") $(du -h initrd.cpio.gz | cut -f1) initramfs"
