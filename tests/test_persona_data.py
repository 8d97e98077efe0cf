"""scripts/make_persona_data.py: the rule-based pirate rewrite used to fine-tune a target for issue 16 (prose
rewritten, code spans untouched, case kept)."""

import importlib.util
import os

spec = importlib.util.spec_from_file_location(
    "make_persona_data", os.path.join(os.path.dirname(__file__), "..", "scripts", "make_persona_data.py"))
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)


def test_prose_rewritten_code_kept():
    text = "The answer is yes, my friend.\n```python\nfor the in my_list: print(is_you)\n```\nYou are done, `the_var`."
    out = mod.pirate(text)
    assert out.startswith("Arr, matey! Th' answer be aye, me matey.")
    assert "```python\nfor the in my_list: print(is_you)\n```" in out and "`the_var`" in out
    assert out.endswith("Ye be done, `the_var`.")
    assert mod.pirate("THE END") == "Arr, matey! TH' END"
    assert mod.pirate("theory of everyone") == "Arr, matey! theory o' all hands"  # whole words only
