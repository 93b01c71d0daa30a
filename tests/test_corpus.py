import hashlib

import numpy as np
import pytest

from spikeguard.data import load_corpus


def test_pydoc_corpus_is_real_text_with_a_recorded_hash():
    from pydoc_data.topics import topics

    c = load_corpus("pydoc")
    raw = np.concatenate([c.train, c.val]).tobytes()
    assert hashlib.sha256(raw).hexdigest() == c.sha256
    assert b"assignment" in raw and topics["assert"].encode()[:40] in raw
    assert abs(len(c.val) / len(raw) - 0.1) < 0.01
    assert c.train.dtype == np.uint8 and c.vocab_size == 256


def test_stdlib_corpus_and_errors():
    c = load_corpus("stdlib")
    assert b"def " in c.train[:200_000].tobytes()
    with pytest.raises(ValueError, match="unknown"):
        load_corpus("wikipedia")
    with pytest.raises(ValueError, match="val_fraction"):
        load_corpus("pydoc", val_fraction=0.9)


def test_corpora_compare_by_content_without_comparing_arrays():
    a, b = load_corpus("pydoc"), load_corpus("pydoc")
    assert a == b and a is not b and hash(a) == hash(b)
    assert a != load_corpus("pydoc", val_fraction=0.2) and a != load_corpus("stdlib")
