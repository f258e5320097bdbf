# shellcheck shell=sh
# The carry's last step, on a host: each unpacked root ($3...) renamed from the temp dir ($2) into the cache dir ($1)
# unless the host has it by now, then the temp dir removed. A root's parent is reached one directory at a time, never
# through a link (the container may have planted one to /etc), must resolve inside the cache dir, and the rename is
# made from inside it. One line per root: "placed R", "present R" or "refused R: why".
d=$1
t=$2
shift 2
trap '' HUP PIPE
mkdir -p "$d" && real=$(cd -P -- "$d" && pwd -P) || exit 1

place() (
  cd -P -- "$d" || exit 1
  set -f
  IFS=/
  case "$1" in */*) parent=${1%/*} ;; *) parent= ;; esac
  for c in $parent; do
    if [ -L "$c" ] || { [ -e "$c" ] && [ ! -d "$c" ]; }; then
      echo "refused $1: $c is not a directory"
      exit 0
    fi
    [ -d "$c" ] || mkdir -m 755 -- "$c" || exit 1
    cd -P -- "$c" || exit 1
  done
  case "$(pwd -P)/" in "$real"/*) ;; *) echo "refused $1: it leads out of the cache dir"; exit 0 ;; esac
  name=${1##*/}
  if [ -e "$name" ] || [ -L "$name" ]; then
    echo "present $1"
  else
    mv -T -- "$t/$1" "$name" && echo "placed $1"
  fi
)

ok=0
for root; do
  place "$root" || ok=1
done
rm -rf "$t"
exit $ok
