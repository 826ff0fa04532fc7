for f in .gl/*.deb; do dpkg -x $f / >/dev/null 2>&1; done; ldconfig; NOTESTS=1 FULL=1 bash .bin2/p2.sh
