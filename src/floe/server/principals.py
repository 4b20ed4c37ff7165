"""Who is asking: every request is resolved to a `Principal` at the edge (server/edge.py), before
its body is read, and one rule (`Principal.may_see` / `may_change`) answers whether it may see
or change a resource, for every protocol.

Credentials (`[server]` settings):
* `token` (the bearer token, `FLOE_TOKEN`): the **operator**, the one user of the shared backend
  (native `/api/{op}`, `/info`, `/tokenizer`, `/metrics`, the OpenAI `/v1` routes and the
  prime-rl / vLLM routes). Sent as `Authorization: Bearer <token>`, or as `X-API-Key` (the
  tinker SDK's header) on the Tinker routes.
* `tinker_api_keys`: **tenants** of the Tinker service (`/api/v1`), one per key. A tenant owns
  the sessions, runs, samplers and checkpoints it makes; it cannot use the operator's routes.
* none of them (a loopback server only: `auth.check_exposure`): every request is the one
  **local** user, with the operator's rights.

Whenever the server has any credential, no route but `/health` and `/ready` answers without
one. A principal's `id` is stable and not secret (a tenant's is a hash of its key), so owners
persist across restarts and appear in listings without revealing a key.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from floe.server.errors import ApiError

__all__ = ["LOCAL", "OPERATOR", "Credentials", "Principal"]


@dataclass(frozen=True)
class Principal:
    """A resolved requester. `operator`: may use the shared backend's routes."""

    id: str
    operator: bool

    def may_see(self, owner: str, public: bool = False) -> bool:
        """Whether this principal may read a resource `owner` owns (`public`: its owner published it)."""
        return public or owner == self.id

    def may_change(self, owner: str) -> bool:
        """Whether this principal may change or delete a resource `owner` owns."""
        return owner == self.id


OPERATOR = Principal("operator", operator=True)
LOCAL = Principal("local", operator=True)


def tenant_id(key: str) -> str:
    """The stable, non-secret id of a Tinker key's tenant."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]


class Credentials:
    """The server's credentials, and `resolve` from a request's headers."""

    def __init__(self, token: str | None, tinker_keys: list[str]):
        self.token = token or None
        self.keys = {k: Principal(tenant_id(k), operator=False) for k in tinker_keys}

    @property
    def any(self) -> bool:
        return self.token is not None or bool(self.keys)

    def resolve(self, authorization: str | None, api_key: str | None) -> Principal:
        """The principal these headers prove; LOCAL when the server has no credentials.
        ApiError 401 when it has some and the headers carry none of them."""
        if not self.any:
            return LOCAL
        given: list[str] = []
        scheme, _, bearer = (authorization or "").partition(" ")
        if scheme.lower() == "bearer" and bearer.strip():
            given.append(bearer.strip())
        if api_key:
            given.append(api_key.strip())
        for secret in given:
            if self.token is not None and hmac.compare_digest(secret.encode(), self.token.encode()):
                return OPERATOR
            for key, principal in self.keys.items():
                if hmac.compare_digest(secret.encode(), key.encode()):
                    return principal
        what = "Authorization: Bearer <token>" if self.token else "X-API-Key: <a Tinker key>"
        if self.token and self.keys:
            what += " (or X-API-Key: <a Tinker key> on /api/v1)"
        raise ApiError(401, "unauthorized", f"missing or wrong credential: send {what}")
