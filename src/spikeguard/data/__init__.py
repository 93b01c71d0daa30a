"""Training data: the corpus that ships with Python and a resumable token stream."""

from ._loader import StreamLoader
from .corpus import CORPORA, Corpus, load_corpus
from .stream import TokenStream

__all__ = ["CORPORA", "Corpus", "StreamLoader", "TokenStream", "load_corpus"]
