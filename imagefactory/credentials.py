"""Patterns that find a credential in a value (user:password@ in a URL, a ?token= parameter): such
a value would be baked into an image layer.
"""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, urlsplit


# scheme://user[:password]@ anywhere in a string (a URL inside an env or label value too). No
# scheme before "://": a pattern that starts with [A-Za-z]+ is quadratic on a long run of letters.
CREDENTIALS_RE = re.compile(r"://[^/?#\s@]*@")


# A query or fragment parameter whose name says it carries a credential: token=, key=, api_key=,
# password=, secret=, sig=, X-Amz-Signature=, X-Amz-Credential=, auth=... (checked per URL).
CREDENTIAL_PARAM_RE = re.compile(r"(?:[a-z0-9]+[_.-])*(?:token|key|apikey|accesstoken|authtoken|password|passwd|pwd|"
                                 r"secret|sig|signature|credentials?|auth|authorization|session)", re.IGNORECASE)


URL_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]{0,30}://\S{1,4000}")


CREDENTIALS_MESSAGE = ("credentials in a URL (user:password@, or a ?token=/key=/password=/sig= parameter) would be "
                       "baked into an image layer and its history; put the login in a netrc file and build with "
                       "--builder buildkit --netrc PATH (a build secret, never in a layer)")


def has_credentials(text: str) -> bool:
    """Whether `text` holds a URL with userinfo or with a credential-named query parameter."""
    if "://" not in text:
        return False
    if CREDENTIALS_RE.search(text):
        return True
    for url in URL_RE.findall(text[:100_000]):
        try:
            parts = urlsplit(url)
        except ValueError:  # not a URL after all (an unbalanced "[" in its host)
            continue
        for section in (parts.query, parts.fragment):
            for name, _ in parse_qsl(section, keep_blank_values=True):
                if CREDENTIAL_PARAM_RE.fullmatch(name.strip()[:100]):
                    return True
    return False
