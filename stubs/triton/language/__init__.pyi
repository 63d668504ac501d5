# triton.language is typed as Any: kernel bodies (tl.load, tl.dot, tl.constexpr, ...) are checked by triton itself.
from typing import Any

def __getattr__(name: str) -> Any: ...
