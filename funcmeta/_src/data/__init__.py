"""Task distributions and datasets (:mod:`funcmeta.data`): ``sinusoid`` samples regression
tasks; ``episodes`` draws N-way K-shot episodes from labelled data; ``omniglot`` loads
Omniglot and its official one-shot runs; ``download`` and ``files`` fetch the official
files and verify their checksums and members."""
