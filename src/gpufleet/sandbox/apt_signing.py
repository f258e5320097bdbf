"""Throwaway signing keys for the sandbox's stand-in apt repos, so apt verifies them as it does the vendors'."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from types import TracebackType

from gpufleet.sandbox.procs import run


class ThrowawayKey:
    """An ed25519 signing key in its own GNUPGHOME; leaving the block ends its gpg-agent and deletes the home."""

    def __init__(self, home: Path, uid: str):
        self.home = home
        shutil.rmtree(home, ignore_errors=True)
        home.mkdir(mode=0o700, parents=True)
        self._env = {**os.environ, "GNUPGHOME": str(home)}
        run(["gpg", "--batch", "--passphrase", "", "--quick-gen-key", uid, "ed25519", "sign", "never"], env=self._env)

    def __enter__(self) -> ThrowawayKey:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        run(["gpgconf", "--homedir", str(self.home), "--kill", "all"], env=self._env, check=False)
        shutil.rmtree(self.home, ignore_errors=True)

    def armored_public_key(self) -> str:
        return run(["gpg", "--armor", "--export"], env=self._env).stdout

    def sign_release(self, directory: Path) -> None:
        """InRelease and Release.gpg next to directory/Release."""
        run(["gpg", "--batch", "--yes", "--clearsign", "-o", "InRelease", "Release"], cwd=directory, env=self._env)
        run(["gpg", "--batch", "--yes", "-abs", "-o", "Release.gpg", "Release"], cwd=directory, env=self._env)
