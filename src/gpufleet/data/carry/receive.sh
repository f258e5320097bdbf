# shellcheck shell=sh
# The carry's receiving end, on a host: the tar stream on stdin unpacked into a new root-only temp dir ($1) beside
# the cache dir; the stream's sha256 and tar's exit status ("tar-rc N") on stderr. Temp dirs a killed carry left
# (named $2*) go first, under the host's lock. No owner or mode comes from the stream; anything but regular files
# and directories refuses it whole (tar-rc 90). A cut or refused stream removes its temp dir.
t=$1
stale=$2
trap '' HUP PIPE
rm -rf "${stale:?}"*
mkdir -m 700 "$t" && {
  { tee /dev/fd/4 | sha256sum >&2; } 4>&1 | tar -C "$t" --no-same-owner --no-same-permissions -xf -
  rc=$?
  if [ $rc = 0 ]; then
    b=$(find "$t" -mindepth 1 \( \( ! -type f ! -type d \) -o \( -type f -links +1 \) \) -print -quit)
    if [ -n "$b" ]; then
      echo "not a regular file or directory: ${b#"$t"/}" >&2
      rc=90
    else
      chmod -R u=rwX,go=rX,a-st "$t" && chmod 700 "$t" || rc=$?
    fi
  fi
  [ $rc = 0 ] || rm -rf "$t"
  echo "tar-rc $rc" >&2
}
