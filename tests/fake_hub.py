"""A local stand-in for ``huggingface_hub.HfApi`` (2.4.0) that never opens a connection: a subclass that keeps the
library's own background machinery (``run_as_future``, the ``future_compatible`` wrapper, the one-worker thread
pool) and replaces the three calls that reach the Hub, with the library's signatures, return types and errors.
Every call is recorded in ``calls`` as (method, arguments), in the order the Hub would have received them.

What the real methods do, and so this fake (huggingface_hub 2.4.0, site-packages/huggingface_hub):
- ``whoami`` (hf_api.py 2219-2258, ``_inner_whoami`` 2260-2290) returns the /api/whoami-v2 JSON: ``name``, ``type``
  (hf_api.py 10084-10086 ``_get_namespace``), ``orgs`` as a list of {"name": ...} (hf_api.py 9181-9183), and
  ``auth.accessToken.role`` (_login.py 429-433); a bad token raises ``HfHubHTTPError`` with the 401 response.
- ``create_repo`` (hf_api.py 4577-4786) returns a ``RepoUrl`` of ``{endpoint}/{repo_id}``; ``exist_ok=True``
  swallows the 409 of an existing repository.
- ``upload_folder`` (hf_api.py 5810-6043) is ``@future_compatible`` (hf_api.py 2009-2039: ``run_as_future=True``
  submits it to ``run_as_future``'s ``ThreadPoolExecutor(max_workers=1)``, 2178-2216, and returns the Future);
  ``path_in_repo`` None means the root (5969-5970); it appends ``DEFAULT_IGNORE_PATTERNS`` to the caller's
  ``ignore_patterns`` list in place (5973-5977; utils/_paths.py 26-35); the files it adds are the folder's files
  (recursive, sorted) filtered by ``filter_repo_objects(allow_patterns, ignore_patterns)`` on their path relative to
  the folder, then prefixed with ``path_in_repo`` (``_prepare_upload_folder_additions`` 11625-11677; a missing
  folder raises ``ValueError``, 11643-11644); it returns a ``CommitInfo``.
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import httpx2
from huggingface_hub import CommitInfo, HfApi, RepoUrl
from huggingface_hub.errors import HfHubHTTPError
from huggingface_hub.hf_api import future_compatible
from huggingface_hub.utils import filter_repo_objects
from huggingface_hub.utils._paths import DEFAULT_IGNORE_PATTERNS

ENDPOINT = "https://hub.invalid"  # never resolved: nothing here connects


def http_error(status: int, message: str, path: str = "/api/whoami-v2") -> HfHubHTTPError:
    """The ``HfHubHTTPError`` huggingface_hub raises for an HTTP ``status`` answer (``hf_raise_for_status``; errors.py
    120-136: built from the ``httpx2.Response``, whose request it keeps)."""
    request = httpx2.Request("GET", ENDPOINT + path)
    return HfHubHTTPError(message, response=httpx2.Response(status, request=request))


class FakeHfApi(HfApi):
    """``HfApi`` answering locally. ``user``/``orgs``/``role``: who the token is; ``whoami_error``: what ``whoami``
    raises instead; ``upload_error``: what every upload raises (after being recorded); ``gate``: a
    ``threading.Event`` each upload waits for (a slow upload)."""

    def __init__(self, *, user: str = "tester", orgs=(), role: str = "write", token: str | None = "hf_fake",
                 whoami_error: Exception | None = None, upload_error: Exception | None = None,
                 gate: threading.Event | None = None):
        super().__init__(endpoint=ENDPOINT, token=token)
        self.user, self.orgs, self.role = user, list(orgs), role
        self.whoami_error, self.upload_error, self.gate = whoami_error, upload_error, gate
        self.calls: list[tuple[str, dict]] = []
        self.repos: set[str] = set()
        self.lock = threading.Lock()

    def _record(self, method: str, **arguments) -> None:
        with self.lock:
            self.calls.append((method, arguments))

    def whoami(self, token=None, *, cache: bool = False) -> dict:
        self._record("whoami", token=token)
        if self.whoami_error is not None:
            raise self.whoami_error
        return {"type": "user", "name": self.user, "orgs": [{"name": org} for org in self.orgs],
                "auth": {"type": "access_token", "accessToken": {"displayName": "fake", "role": self.role}}}

    def create_repo(self, repo_id: str, *, token=None, private=None, visibility=None, repo_type=None,
                    exist_ok: bool = False, **space_options) -> RepoUrl:
        self._record("create_repo", repo_id=repo_id, private=private, exist_ok=exist_ok,
                     thread=threading.current_thread().name)
        if repo_id in self.repos and not exist_ok:
            raise http_error(409, "You already created this model repo", "/api/repos/create")
        self.repos.add(repo_id)
        return RepoUrl(f"{self.endpoint}/{repo_id}", endpoint=self.endpoint)

    @future_compatible
    def upload_folder(self, *, repo_id: str, folder_path, path_in_repo: str | None = None,
                      commit_message: str | None = None, commit_description: str | None = None, token=None,
                      repo_type=None, revision=None, create_pr=None, parent_commit=None, allow_patterns=None,
                      ignore_patterns=None, delete_patterns=None, run_as_future: bool = False) -> CommitInfo:
        if self.gate is not None:
            self.gate.wait(30)
        if path_in_repo is None:
            path_in_repo = ""
        if ignore_patterns is None:
            ignore_patterns = []
        elif isinstance(ignore_patterns, str):
            ignore_patterns = [ignore_patterns]
        ignore_patterns += DEFAULT_IGNORE_PATTERNS
        folder = Path(folder_path).expanduser().resolve()
        if not folder.is_dir():
            raise ValueError(f"Provided path: '{folder_path}' is not a directory")
        files = {p.relative_to(folder).as_posix(): p for p in sorted(folder.glob("**/*")) if p.is_file()}
        kept = list(filter_repo_objects(files.keys(), allow_patterns=allow_patterns, ignore_patterns=ignore_patterns))
        prefix = f"{path_in_repo.strip('/')}/" if path_in_repo else ""
        self._record("upload_folder", repo_id=repo_id, folder_path=str(folder_path), path_in_repo=path_in_repo,
                     commit_message=commit_message, files=[prefix + name for name in kept],
                     sha256={prefix + name: hashlib.sha256(files[name].read_bytes()).hexdigest() for name in kept},
                     thread=threading.current_thread().name, repo_existed=repo_id in self.repos)
        if self.upload_error is not None:
            raise self.upload_error
        oid = hashlib.sha1(f"{len(self.calls)}".encode()).hexdigest()
        return CommitInfo(commit_url=f"{self.endpoint}/{repo_id}/commit/{oid}", commit_message=commit_message or "",
                          commit_description=commit_description or "", oid=oid, _endpoint=self.endpoint)

    def uploads(self) -> list[dict]:
        """The recorded ``upload_folder`` calls' arguments, in order."""
        return [args for method, args in self.calls if method == "upload_folder"]
