"""Conditional writes on the files of one output, what the lease needs: create a file only if it
is absent, replace or delete it only if it is still the version read (If-None-Match / If-Match on
S3; a hard link, and a compare under the folder's flock, locally). Other stores cannot compare,
and their writes are unconditional.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Any

from .objects import ObjectFiles, json_bytes, local_tag


class ConditionalFiles(ObjectFiles):
    """ObjectFiles with compare-and-write (OutputStore is one)."""

    def create_exclusive(self, dest: str, obj: Any) -> bool:
        """Write dest only if it does not exist (a hard link locally, If-None-Match: * on S3).
        Returns False when it already exists."""
        data = json_bytes(obj)
        if self.is_local:
            with _folder_lock(dest):  # not between another writer's compare and its replace
                return self._link_new(dest, data)
        try:
            self.fs.pipe_file(dest, data, mode="create")
            return True
        except Exception:
            self.fs.invalidate_cache(dest)
            if self.fs.exists(dest):
                return False
            raise

    @staticmethod
    def _link_new(dest: str, data: bytes) -> bool:
        # Written whole under a private name, then linked into place: link() fails if dest
        # exists, and a reader never sees dest half written.
        folder = dest.rsplit("/", 1)[0]
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".create-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chmod(tmp, 0o644)
            try:
                os.link(tmp, dest)
                return True
            except FileExistsError:
                return False
            except OSError:  # a filesystem without hard links: O_EXCL, briefly visible empty
                try:
                    fd = os.open(dest, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
                except FileExistsError:
                    return False
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                return True
        finally:
            os.unlink(tmp)

    def delete_if(self, dest: str, tag: str | None) -> bool:
        """Delete dest only if it is still the version read_json_tagged tagged (False when it is
        not): under the folder's lock locally, a DELETE with If-Match on S3. Without a tag, as
        delete."""
        if tag is None:
            self.delete(dest)
            return True
        if self.is_local:
            with _folder_lock(dest):
                if local_tag(dest) != tag:
                    return False
                os.unlink(dest)
                return True
        if not self.is_s3:
            self.delete(dest)
            return True
        bucket, key, _ = self.fs.split_path(dest)
        try:
            self._s3("delete_object", Bucket=bucket, Key=key, IfMatch=tag)
        except FileNotFoundError:
            return False
        except Exception as e:
            if _precondition_failed(e):
                return False
            # A store that refuses conditional deletes (older S3-compatible servers): as delete.
            self.delete(dest)
        finally:
            self.fs.invalidate_cache(dest)
        return True

    def _s3(self, method: str, **kwargs):
        """One S3 API call through the store's s3fs client (its endpoint, credentials, retries)."""
        from fsspec.asyn import sync

        return sync(self.fs.loop, self.fs._call_s3, method, **kwargs)

    def replace_json_if(self, dest: str, obj: Any, tag: str | None) -> bool:
        """Replace dest only if it is still the version read_json_tagged tagged, else return
        False: a conditional PUT (If-Match) on S3, whose 412 returns False; locally the compare
        and the rename under the folder's lock, which every conditional writer of the output's
        metadata takes. Without a tag (other stores) the write is unconditional, as write_json's."""
        if self.is_local and tag is not None:
            with _folder_lock(dest):
                if local_tag(dest) != tag:
                    return False
                self.write_json(dest, obj)
                return True
        if tag is None or not self.is_s3:
            self.write_json(dest, obj)
            return True
        data = json_bytes(obj)
        try:
            self.fs.pipe_file(dest, data, IfMatch=tag)
            return True
        except OSError as e:
            if _precondition_failed(e):
                self.fs.invalidate_cache(dest)
                return False
            raise


@contextlib.contextmanager
def _folder_lock(dest: str):
    """An exclusive flock on dest's folder for a compare-and-write among the processes that share
    this filesystem (the folder, not dest: dest is replaced by rename, and a lock on the file
    replaced would guard nothing). Where flock is unsupported the write goes on unlocked."""
    folder = os.path.dirname(dest) or "."
    os.makedirs(folder, exist_ok=True)
    fd = os.open(folder, os.O_RDONLY)
    try:
        try:
            import fcntl

            fcntl.flock(fd, fcntl.LOCK_EX)
        except (ImportError, OSError):
            pass
        yield
    finally:
        os.close(fd)  # releases the lock


def _precondition_failed(e: BaseException | None) -> bool:
    """An S3 conditional write refused (HTTP 412), as s3fs raises it: an OSError over botocore's
    ClientError with the code PreconditionFailed."""
    for _ in range(8):  # down the exception's chain
        if e is None:
            return False
        response = getattr(e, "response", None)
        code = response.get("Error", {}).get("Code") if isinstance(response, dict) else None
        if code in ("PreconditionFailed", "412") or "pre-condition" in str(e).lower():
            return True
        e = e.__cause__ or e.__context__
    return False
