"""The offline arithmetic tasks' data: the first problems of the test split that
`python data/prepare.py arith` writes (its default seed, digits and operators), as problems.jsonl
beside this file, one {"question", "answer", "choices", "gold"} a line. lm_eval reads it through
load_problems (the YAMLs' custom_dataset). Rebuild it with `python tasks/arith/utils.py`."""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
PROBLEMS = os.path.join(HERE, 'problems.jsonl')
COUNT = 40


def build_rows(count=COUNT):
    """The first `count` test problems of the default arith task, each with four choices: the
    answer and three near misses (off by one, by ten), the answer at position i mod 4."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
    from data import prepare
    a = prepare.DEFAULTS['arith']
    # the draws are the same whatever the counts, and a problem's split is a hash of its operands:
    # asking for test problems only gives the full task's first test problems, in its order
    problems = prepare.arith_problems(a['seed'], a['digits'], a['ops'],
                                      {'train': 0, 'val': 0, 'test': count})
    rows = []
    for i, (x, op, y, answer) in enumerate(problems['test'][:count]):
        misses = [m for m in (answer + 1, answer - 1, answer + 10, answer + 11) if m >= 0][:3]
        choices = [f'{m}\n' for m in misses]
        choices.insert(i % 4, f'{answer}\n')
        rows.append(dict(question=f'{x}{op}{y}=', answer=str(answer), choices=choices,
                         gold=i % 4))
    return rows


def load_problems(**_):
    """{'test': datasets.Dataset} of problems.jsonl (lm_eval's custom_dataset hook)."""
    import datasets
    with open(PROBLEMS) as f:
        rows = [json.loads(line) for line in f]
    for row in rows:
        row['text'] = row['question'] + row['answer'] + '\n'     # what the rolling task scores
    return {'test': datasets.Dataset.from_list(rows)}


if __name__ == '__main__':
    with open(PROBLEMS, 'w') as f:
        f.writelines(json.dumps(row) + '\n' for row in build_rows())
    print(f'wrote {PROBLEMS}')
