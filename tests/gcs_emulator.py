"""A local Cloud Storage emulator for tests of `gs://` workdirs (no network, no credentials).

`GcsEmulator` runs `gcp-storage-emulator` (pure Python, in memory) in a subprocess on a free port
of 127.0.0.1, creates a bucket, and points every library of a run at it until `stop()`:

- gcsfs (fsspec, which `etils.epath` and TensorBoard's reader use for gs://): env
  `STORAGE_EMULATOR_HOST`, anonymous credentials (fsspec config `token="anon"`, env
  `FSSPEC_GCS_TOKEN` for subprocesses), and the plain `gcsfs.core.GCSFileSystem`: the default
  `ExtendedGcsFileSystem` asks the gRPC Storage Control API for the bucket type before a rename,
  which no HTTP emulator serves (each rename would wait for a 60 s timeout); env
  `GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false` does the same for processes that import gcsfs later.
- tensorstore (orbax's array storage): env `TENSORSTORE_GCS_HTTP_URL` and
  `GOOGLE_AUTH_TOKEN_FOR_TESTING` (a bearer token the emulator ignores), read when the first gcs
  kvstore opens: start the emulator before the process first touches gs://.

The server started here adds to `gcp-storage-emulator` what these clients need and it lacks:
- `objects.move` (`.../moveTo/...`), which gcsfs tries first for a rename (it would retry the 501
  for half a minute before copying): a copy, then a delete.
- generation preconditions (`ifGenerationMatch`, `ifGenerationNotMatch`: 412 / 304) on reads,
  media uploads and deletes, and the `x-goog-generation` header on reads: tensorstore's OCDBT
  (orbax's array format) reads an object's generation from that header and updates its manifest
  with conditional writes, which fail with "Malformed StorageGeneration" without it.
Run `python tests/gcs_emulator.py BUCKET` to serve by hand: it prints the port and, on a
terminal, the `export` lines that point another shell's trainer at it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

_ENV_VARS = (
  "STORAGE_EMULATOR_HOST",
  "FSSPEC_GCS_TOKEN",
  "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT",
  "NO_GCE_CHECK",
  "TENSORSTORE_GCS_HTTP_URL",
  "GOOGLE_AUTH_TOKEN_FOR_TESTING",
)


class GcsEmulator:
  """An in-memory Cloud Storage server in a subprocess, with `bucket` created, and this process's
  gcsfs, etils.epath, TensorBoard and tensorstore pointed at it (see the module docstring).

  Use as a context manager or call `start()` / `stop()`; `url(path)` gives `gs://<bucket>/<path>`.
  """

  def __init__(self, bucket: str = "bucket", *, start_timeout_s: float = 30.0):
    """An emulator (not yet started) that will serve `bucket`."""
    self.bucket = bucket
    self.port: int | None = None
    self._timeout = start_timeout_s
    self._proc: subprocess.Popen | None = None
    self._saved_env: dict[str, str | None] = {}
    self._saved_fsspec: dict = {}

  @property
  def endpoint(self) -> str:
    """`http://127.0.0.1:<port>` of the running server."""
    return f"http://127.0.0.1:{self.port}"

  def url(self, path: str = "") -> str:
    """`gs://<bucket>/<path>`."""
    return f"gs://{self.bucket}/{path.lstrip('/')}"

  def start(self) -> GcsEmulator:
    """Starts the server, waits until it answers, and points the libraries at it."""
    self._proc = subprocess.Popen(
      [sys.executable, os.path.abspath(__file__), self.bucket],
      stdout=subprocess.PIPE,  # its port; its errors go to this process's stderr
      text=True,
    )
    line = self._proc.stdout.readline()  # the server prints its port once it listens
    if not line.strip().isdigit():
      self._proc.kill()
      raise RuntimeError(f"the storage emulator did not start (printed {line!r})")
    self.port = int(line)
    self._wait_until_up()
    self._point_libraries()
    return self

  def _wait_until_up(self) -> None:
    import urllib.request

    deadline = time.monotonic() + self._timeout
    while True:
      try:
        with urllib.request.urlopen(f"{self.endpoint}/storage/v1/b/{self.bucket}", timeout=5):
          return
      except OSError:
        if time.monotonic() > deadline or self._proc.poll() is not None:
          self.stop()
          raise
        time.sleep(0.05)

  def _point_libraries(self) -> None:
    env = emulator_env(self.endpoint)
    self._saved_env = {k: os.environ.get(k) for k in _ENV_VARS}
    os.environ.update(env)

    import fsspec
    import gcsfs.core

    conf = fsspec.config.conf
    self._saved_fsspec = {p: dict(conf[p]) if p in conf else None for p in ("gs", "gcs")}
    for protocol in ("gs", "gcs"):
      conf.setdefault(protocol, {})["token"] = "anon"
      fsspec.register_implementation(protocol, gcsfs.core.GCSFileSystem, clobber=True)
    self._forget_filesystems()

  @staticmethod
  def _forget_filesystems() -> None:
    """Drops the cached gs:// file systems (fsspec's and etils.epath's), bound to old settings."""
    import gcsfs
    from etils.epath import backend

    gcsfs.core.GCSFileSystem.clear_instance_cache()
    backend.fsspec_backend._get_filesystem.cache_clear()

  def stop(self) -> None:
    """Stops the server and restores the environment and fsspec settings it changed."""
    if self._proc is not None:
      self._proc.terminate()
      try:
        self._proc.wait(timeout=10)
      except subprocess.TimeoutExpired:
        self._proc.kill()
        self._proc.wait()
      self._proc.stdout.close()
      self._proc = None
    for k, v in self._saved_env.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v
    self._saved_env = {}
    if self._saved_fsspec:
      import fsspec

      for protocol, saved in self._saved_fsspec.items():
        if saved is None:
          fsspec.config.conf.pop(protocol, None)
        else:
          fsspec.config.conf[protocol] = saved
      self._saved_fsspec = {}
      self._forget_filesystems()

  def __enter__(self) -> GcsEmulator:
    return self.start()

  def __exit__(self, *exc) -> None:
    self.stop()


def emulator_env(endpoint: str) -> dict[str, str]:
  """The environment that points a process's gcsfs, etils.epath, TensorBoard and tensorstore
  at the emulator at `endpoint` (enough for a separate trainer process)."""
  return {
    "STORAGE_EMULATOR_HOST": endpoint,
    "FSSPEC_GCS_TOKEN": "anon",
    "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
    "NO_GCE_CHECK": "true",
    "TENSORSTORE_GCS_HTTP_URL": endpoint,
    "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator",
  }


def _serve(bucket: str) -> None:
  """Serves an in-memory emulator with `bucket` on a free port of 127.0.0.1; prints the port."""
  import logging
  import re
  from functools import partial
  from http import HTTPStatus, server

  from gcp_storage_emulator import server as emulator
  from gcp_storage_emulator.exceptions import NotFound
  from gcp_storage_emulator.handlers import buckets, objects
  from gcp_storage_emulator.storage import Storage

  logging.disable(logging.CRITICAL)

  def move(request, response, storage, *args, **kwargs):
    """objects.move: `POST /storage/v1/b/<bucket>/o/<src>/moveTo/o/<dst>` (copy, then delete)."""
    p = request.params
    try:
      moved = objects._copy(
        request.base_url, storage, p["bucket_name"], p["object_id"], p["bucket_name"], p["dst"]
      )
      storage.delete_file(p["bucket_name"], p["object_id"])
    except NotFound:
      response.status = HTTPStatus.NOT_FOUND
      return
    response.json(moved)

  def generation(storage, bucket: str, name: str) -> str | None:
    try:
      return str(storage.get_file_obj(bucket, name)["generation"])
    except NotFound:
      return None

  def preconditions(handler, *, read: bool):
    """`handler` with GCS's generation preconditions checked first (and, for reads, the
    object's generation in `x-goog-generation` / `x-goog-metageneration`)."""

    def checked(request, response, storage, *args, **kwargs):
      bucket = request.params["bucket_name"]
      name = request.params.get("object_id") or (request.query.get("name") or [None])[0]
      current = generation(storage, bucket, name) if name else None
      match = (request.query.get("ifGenerationMatch") or [None])[0]
      not_match = (request.query.get("ifGenerationNotMatch") or [None])[0]
      if name and (current is not None or not read):
        if match is not None and (current or "0") != match:
          response.status = HTTPStatus.PRECONDITION_FAILED
          return
        if not_match is not None and (current or "0") == not_match:
          response.status = HTTPStatus.NOT_MODIFIED if read else HTTPStatus.PRECONDITION_FAILED
          return
      handler(request, response, storage, *args, **kwargs)
      if (
        read
        and current is not None
        and response.status in (HTTPStatus.OK, HTTPStatus.PARTIAL_CONTENT)
      ):
        obj = storage.get_file_obj(bucket, name)
        response["x-goog-generation"] = str(obj["generation"])
        response["x-goog-metageneration"] = str(obj.get("metageneration", "1"))

    return checked

  wrapped = {
    objects.get: preconditions(objects.get, read=True),
    objects.download: preconditions(objects.download, read=True),
    objects.insert: preconditions(objects.insert, read=False),
    objects.delete: preconditions(objects.delete, read=False),
  }
  api = re.escape(emulator.settings.API_ENDPOINT)
  route = rf"^{api}/b/(?P<bucket_name>[-.\w]+)/o/(?P<object_id>.*[^/]+)/moveTo/o/(?P<dst>.*[^/]+)$"
  emulator.HANDLERS = (
    (route, {emulator.POST: move}),
    *(
      (regex, {m: wrapped.get(h, h) for m, h in methods.items()})
      for regex, methods in emulator.HANDLERS
    ),
  )

  class Server(server.HTTPServer):
    request_queue_size = 128  # tensorstore opens many connections at once

    def handle_error(self, request, client_address):
      if not isinstance(sys.exc_info()[1], ConnectionError):  # a client that hung up early
        super().handle_error(request, client_address)

  storage = Storage(use_memory_fs=True)
  buckets.create_bucket(bucket, storage)
  httpd = Server(("127.0.0.1", 0), partial(emulator.RequestHandler, storage))
  port = httpd.server_address[1]
  print(port, flush=True)
  if sys.stdout.isatty():  # by hand: what to paste into the shell that runs the trainer
    for k, v in emulator_env(f"http://127.0.0.1:{port}").items():
      print(f"export {k}={v}", flush=True)
  httpd.serve_forever()


if __name__ == "__main__":
  _serve(sys.argv[1] if len(sys.argv) > 1 else "bucket")
