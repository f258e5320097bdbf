# shellcheck shell=sh
# The carry's sending end, on the canary: the NUL-separated paths on stdin (relative to the cache dir, $1) as a tar
# stream on stdout; the stream's sha256 and tar's exit status ("tar-rc N") on stderr.
cd "$1" && { { tar --null -T - -cf -; echo "tar-rc $?" >&2; } | tee /dev/fd/3 | sha256sum >&2; } 3>&1
