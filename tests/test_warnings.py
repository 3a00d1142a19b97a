"""Deprecation warnings: a FutureWarning or DeprecationWarning that our own code provokes is an error in the suite
(the wrapper in tests/conftest.py), one that third-party code raises on its own behalf stays a warning, and the
trainer's calls into transformers provoke none."""
import os
import warnings

import pytest
import torch

import pacs

import plumbing
from conftest import ROOT

OURS = os.path.join(ROOT, "experiments", "warning_probe.py")  # code compiled under these names runs as theirs/ours
THEIRS = os.path.join(os.sep, "site-packages", "thirdparty", "api.py")
LIBRARY = """
import warnings
def deprecated_api(category):
    warnings.warn("deprecated_api is deprecated", category, stacklevel=2)  # attributed to its caller
def entry_point(category):
    deprecated_api(category)  # the library calling its own deprecated API, on its own behalf
"""


def run_as(path, source, **names):
    """Run source with `path` as its frames' file name, so the wrapper sees it as that file's code."""
    exec(compile(source, path, "exec"), names)
    return names


@pytest.fixture
def library():
    return run_as(THEIRS, LIBRARY)


@pytest.mark.parametrize("category", [FutureWarning, DeprecationWarning])
def test_our_call_of_a_deprecated_api_is_an_error(library, category):
    with pytest.raises(category, match="deprecated_api is deprecated"):
        run_as(OURS, "deprecated_api(category)", deprecated_api=library["deprecated_api"], category=category)


@pytest.mark.parametrize("category", [FutureWarning, DeprecationWarning])
def test_a_library_calling_its_own_deprecated_api_stays_a_warning(library, category):
    with pytest.warns(category, match="deprecated_api is deprecated"):
        run_as(OURS, "entry_point(category)", entry_point=library["entry_point"], category=category)


def test_other_warnings_from_our_calls_stay_warnings(library):
    with pytest.warns(UserWarning, match="deprecated_api is deprecated"):
        run_as(OURS, "deprecated_api(UserWarning)", deprecated_api=library["deprecated_api"])


def test_a_deprecated_forward_keyword_is_an_error_through_torch_and_transformers_wrappers(tiny_model_dir):
    # transformers attributes this one to its own decorator, not to the caller: only the wrapper's walk past the
    # pass-through frames (Module.__call__, transformers' decorators) finds our line
    decoder = plumbing.load_model(tiny_model_dir)[0].get_decoder()
    ids = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(FutureWarning, match="past_key_values"):
        run_as(OURS, "decoder(input_ids=ids, past_key_values=None, use_cache=True)", decoder=decoder, ids=ids)
    with pytest.warns(FutureWarning, match="past_key_values"):  # the same call from third-party code
        run_as(THEIRS, "decoder(input_ids=ids, past_key_values=None, use_cache=True)", decoder=decoder, ids=ids)


def test_sampling_and_the_shared_prompt_forward_raise_no_deprecation_warning(tiny_model_dir):
    # the two calls that reuse a prompt's KV cache: generate from a prefilled cache, the training forward over the
    # responses; any FutureWarning or DeprecationWarning, ours or transformers' own, is reported
    model, tok = plumbing.load_model(tiny_model_dir)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.manual_seed(0)
        roll = pacs.sample(model, tok, [plumbing.build_prompt(tok, "1 + 1 ="), plumbing.build_prompt(tok, "2 + 30 =")],
                           group_size=2, max_new_tokens=4)
        model.train()
        pacs.response_logprobs(model, *plumbing.rollout_rows(roll, slice(0, 4)), 1.0, group_size=2)
    assert [str(w.message) for w in caught if issubclass(w.category, (DeprecationWarning, FutureWarning))] == []
