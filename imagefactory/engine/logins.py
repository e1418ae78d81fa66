"""Registry logins: which credentials go to which registry, for every step that talks to one
(the build's registry cache, publish, the lists' merge, verify).

IMAGEFACTORY_REGISTRY_USER/PASSWORD belong to the matrix's `image` registry alone; each extra
registry under tags.registries has its own _<HOST> pair; without a pair the engine's own login
(`docker login`, credential helpers) is used. Credentials are never printed or stored: `redact`
takes them out of any text that is shown.
"""

from __future__ import annotations

import os

from imagefactory.config import refs
from imagefactory.config import registries
from imagefactory.config import tags
from imagefactory.config.model import Matrix
from imagefactory.config.registries import PASSWORD_ENV, USER_ENV, Registry
from imagefactory.errors import ConfigError, PushError

Auth = dict[str, str]


def _pair(user_env: str, password_env: str) -> Auth | None:
    user, password = os.environ.get(user_env), os.environ.get(password_env)
    if user and password:
        return {"username": user, "password": password}
    if user or password:
        raise ConfigError(f"set both {user_env} and {password_env}, or neither (to use `docker login`)")
    return None


def credentials() -> Auth | None:
    """The credentials of `image`'s registry from the environment, else None: the SDK then uses
    the Docker config and its credential helpers (`docker login`). Never printed or stored."""
    return _pair(USER_ENV, PASSWORD_ENV)


def registry_credentials(matrix: Matrix) -> dict[str, Auth | None]:
    """Credentials per registry, as Docker's config keeps them: IMAGEFACTORY_REGISTRY_USER/PASSWORD
    belong to `image`'s registry alone; a registry under tags.registries gets
    IMAGEFACTORY_REGISTRY_USER_<HOST>/PASSWORD_<HOST> (Registry.credential_variables), or None
    (`docker login`)."""
    own, *extra = registries.allowed_registries(matrix)
    found: dict[str, Auth | None] = {own: credentials()}
    for registry in extra:
        found[registry] = _pair(*Registry(registry).credential_variables(own=False))
    return found


def auth_for(ref: str, creds: dict[str, Auth | None]) -> Auth | None:
    """The credentials that may go with a push of `ref`: its own registry's, and only for a
    registry the matrix allows (anything else is refused, never sent another registry's)."""
    why = tags.refusal(ref, tuple(creds))
    if why:
        raise PushError(f"not pushed: {why}", transient=False)
    registry = refs.registry(ref)
    return creds[registry] if registry else None


def redact(text: str, creds: dict[str, Auth | None]) -> str:
    for auth in creds.values():
        if auth and auth.get("password"):
            text = text.replace(auth["password"], "***")
    return text
