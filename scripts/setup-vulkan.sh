#!/usr/bin/env bash
# Makes sure a Vulkan driver is present: keeps an existing one (a GPU driver), otherwise installs
# the Vulkan loader and Mesa's lavapipe CPU driver (Debian/Ubuntu). Prints the driver in use.
set -euo pipefail
have_icd() {
  ls /usr/share/vulkan/icd.d/*.json /etc/vulkan/icd.d/*.json /usr/local/share/vulkan/icd.d/*.json 2>/dev/null | grep -q . &&
    ldconfig -p | grep -q 'libvulkan.so.1'
}
if ! have_icd; then
  SUDO=""
  if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq libvulkan1 mesa-vulkan-drivers >/dev/null
fi
ls /usr/share/vulkan/icd.d/ /etc/vulkan/icd.d/ 2>/dev/null | grep json | sed 's/^/vulkan driver: /' || true
