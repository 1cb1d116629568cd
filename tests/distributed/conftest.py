from __future__ import annotations

import pytest

from megascale.data.corpus import default_token_file


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """The built-in corpus's token file, built once for every distributed test."""
    directory = tmp_path_factory.mktemp("data")
    default_token_file(directory)
    return directory
