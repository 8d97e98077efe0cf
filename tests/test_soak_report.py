"""The soak's acceptance check (bench/soak_report.py): a drafter without server history must keep its acceptance
exactly; suffix decoding's server-wide tries learn what the server served, so there only a fall is a fault."""

from specloom.bench.soak_report import checks, learns_from_history


def _summary(spec, before, after, first=1.0, last=1.0):
    return {"speculative_config": spec, "lost": 0, "corrupted": 0, "identical_to_alone": 3, "answered_greedy": 3,
            "valid_5xx_client": 0, "valid_5xx_server": 0, "valid_refused_4xx": 0, "bad_requests": 2,
            "bad_requests_4xx": 2, "rss_mib": {"growth": 0.01}, "alone_end_identical": 1,
            "kinds": {"valid": {"sent": 1}},
            "acceptance": {"tau_alone_start": before, "tau_alone_end": after, "soak_first_half": {"ratio": first},
                           "soak_last_half": {"ratio": last}}}


def test_learns_from_history():
    assert learns_from_history('{"method": "eagle3", "suffix_decoding": true}')
    assert learns_from_history('{"method": "suffix"}')
    assert not learns_from_history('{"method": "ngram"}') and not learns_from_history(None)
    assert not learns_from_history("not json")


def test_acceptance_check():
    ok = lambda spec, *a: checks(_summary(spec, *a), [1], 200, 0, 0)["acceptance_end_equals_start"]  # noqa: E731
    hybrid, ngram = '{"method": "eagle3", "suffix_decoding": true}', '{"method": "ngram"}'
    assert ok(hybrid, 1.9, 6.6) and not ok(hybrid, 1.9, 1.5)  # a rise is the tries learning; a fall is a fault
    assert not ok(hybrid, 1.9, 1.9, 1.0, 0.8)  # the soak's own windows fell
    assert ok(ngram, 1.9, 1.9) and not ok(ngram, 1.9, 2.0) and not ok(ngram, 1.9, 1.8)
