"""imagefactory: one matrix file in, tested and published training images out."""

__version__ = "0.1.0"
