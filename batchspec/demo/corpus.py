"""Seeded synthetic contracts with one-sentence reference summaries.

Five contract types (lease, NDA, employment, promissory note, services) with random parties,
dates, amounts, terms and governing law, optional clauses and free-text boilerplate, so the
summaries must copy key facts out of a varied document. Disjoint splits come from disjoint seed
ranges: train uses seeds [0, 1e6), eval [1e6, 2e6), the demo's input shards [2e6, ...).

    contract, summary = make_contract(random.Random(5))
"""

from __future__ import annotations

import random

PROMPT = "Summarize the contract.\n{contract}\nSummary:"
SPLIT_SEEDS = {"train": 0, "eval": 1_000_000, "demo": 2_000_000}

FIRST = ["Maria", "James", "Aiko", "David", "Priya", "Lucas", "Fatima", "Noah", "Elena", "Omar", "Grace", "Ivan",
         "Chloe", "Mateo", "Sara", "Kwame", "Hannah", "Leo", "Nadia", "Victor"]
LAST = ["Garcia", "Smith", "Tanaka", "Brown", "Patel", "Silva", "Khan", "Miller", "Rossi", "Haddad", "Kim", "Petrov",
        "Martin", "Lopez", "Cohen", "Mensah", "Weber", "Novak", "Ali", "Dubois"]
COMPANY_A = ["Acme", "Northwind", "Bluestone", "Redwood", "Silverline", "Oakridge", "Summit", "Harbor", "Pinecrest",
             "Ironwood", "Lakeside", "Brightway", "Cedar", "Granite", "Maple"]
COMPANY_B = ["Holdings", "Logistics", "Labs", "Partners", "Systems", "Foods", "Capital", "Media", "Energy", "Health"]
SUFFIX = ["Inc.", "LLC", "Corp.", "Ltd."]
STATES = ["California", "Texas", "New York", "Delaware", "Florida", "Washington", "Nevada", "Oregon", "Ohio", "Illinois"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
BOILERPLATE = [
    "Each party shall act in good faith in performing its obligations under this Agreement.",
    "Notices must be delivered in writing to the addresses listed above.",
    "This Agreement may be amended only by a written instrument signed by both parties.",
    "If any provision is held invalid, the remaining provisions remain in full force.",
    "Neither party may assign this Agreement without the prior written consent of the other.",
    "Headings are for convenience only and do not affect interpretation.",
    "This Agreement constitutes the entire agreement between the parties.",
    "Failure to enforce any provision is not a waiver of that provision.",
]


def _person(rng):
    return f"{rng.choice(FIRST)} {rng.choice(LAST)}"


def _company(rng):
    return f"{rng.choice(COMPANY_A)} {rng.choice(COMPANY_B)} {rng.choice(SUFFIX)}"


def _date(rng):
    return f"{rng.choice(MONTHS)} {rng.randint(1, 28)}, {rng.randint(2019, 2031)}"


def _money(rng, lo, hi, step):
    return f"${rng.randrange(lo, hi, step):,}"


def _extras(rng, k):
    return " ".join(rng.sample(BOILERPLATE, k))


def lease(rng):
    landlord, tenant = _company(rng), _person(rng)
    rent, months, start, state = _money(rng, 800, 9000, 50), rng.choice([6, 12, 18, 24, 36]), _date(rng), rng.choice(STATES)
    deposit = _money(rng, 500, 20000, 100) if rng.random() < 0.6 else None
    text = (f"RESIDENTIAL LEASE AGREEMENT. This lease is made on {start} between {landlord} (the Landlord) and {tenant} "
            f"(the Tenant). The Tenant shall pay monthly rent of {rent} for a term of {months} months. "
            + (f"A security deposit of {deposit} is due at signing. " if deposit else "")
            + f"{_extras(rng, rng.randint(1, 3))} This lease is governed by the laws of {state}.")
    summary = (f"{tenant} leases from {landlord} for {months} months at {rent} per month starting {start}"
               + (f", with a {deposit} deposit" if deposit else "") + f", under {state} law.")
    return text, summary


def nda(rng):
    a, b = _company(rng), _company(rng)
    years, date, state = rng.randint(1, 7), _date(rng), rng.choice(STATES)
    mutual = rng.random() < 0.5
    text = (f"{'MUTUAL ' if mutual else ''}NON-DISCLOSURE AGREEMENT. Effective {date}, {a} and {b} agree that "
            + ("each party" if mutual else f"{b}") + f" shall keep confidential all information disclosed under this "
            f"Agreement for {years} years. {_extras(rng, rng.randint(1, 3))} The laws of {state} govern this Agreement.")
    summary = (f"{'Mutual' if mutual else 'One-way'} NDA between {a} and {b}, effective {date}, "
               f"with {years}-year confidentiality, under {state} law.")
    return text, summary


def employment(rng):
    employer, employee = _company(rng), _person(rng)
    salary, date, state = _money(rng, 40000, 250000, 1000), _date(rng), rng.choice(STATES)
    title = rng.choice(["Engineer", "Analyst", "Manager", "Designer", "Accountant", "Counsel", "Director"])
    notice = rng.choice([14, 30, 60, 90])
    text = (f"EMPLOYMENT AGREEMENT. {employer} (the Employer) hires {employee} (the Employee) as {title} starting {date} "
            f"at an annual salary of {salary}. Either party may terminate with {notice} days written notice. "
            f"{_extras(rng, rng.randint(1, 3))} This Agreement is governed by {state} law.")
    summary = (f"{employer} employs {employee} as {title} from {date} at {salary} per year, "
               f"terminable on {notice} days notice, under {state} law.")
    return text, summary


def note(rng):
    borrower, lender = _person(rng), _company(rng)
    principal, rate, due, state = _money(rng, 1000, 500000, 500), rng.choice([3, 4, 5, 6, 7, 8, 9, 10, 12]), _date(rng), rng.choice(STATES)
    text = (f"PROMISSORY NOTE. For value received, {borrower} (the Borrower) promises to pay {lender} (the Lender) the "
            f"principal sum of {principal} with interest at {rate} percent per year, due in full on {due}. "
            f"{_extras(rng, rng.randint(1, 3))} This Note is governed by the laws of {state}.")
    summary = f"{borrower} owes {lender} {principal} at {rate}% interest, due {due}, under {state} law."
    return text, summary


def services(rng):
    client, vendor = _company(rng), _company(rng)
    fee, months, date, state = _money(rng, 2000, 90000, 500), rng.choice([3, 6, 12, 24]), _date(rng), rng.choice(STATES)
    service = rng.choice(["software development", "marketing", "cleaning", "consulting", "logistics", "security"])
    text = (f"SERVICES AGREEMENT. On {date}, {client} (the Client) engages {vendor} (the Provider) to perform {service} "
            f"services for {months} months for a monthly fee of {fee}. {_extras(rng, rng.randint(1, 3))} "
            f"This Agreement is governed by the laws of {state}.")
    summary = (f"{vendor} provides {service} services to {client} for {months} months at {fee} per month "
               f"from {date}, under {state} law.")
    return text, summary


KINDS = {"lease": lease, "nda": nda, "employment": employment, "note": note, "services": services}


def make_contract(rng: random.Random) -> tuple[str, str, str]:
    """(kind, contract text, reference summary)."""
    kind = rng.choice(sorted(KINDS))
    text, summary = KINDS[kind](rng)
    return kind, text, summary


def examples(split: str, n: int, offset: int = 0) -> list[dict]:
    """n examples of a split; example i always comes from seed SPLIT_SEEDS[split] + offset + i."""
    out = []
    for i in range(offset, offset + n):
        seed = SPLIT_SEEDS[split] + i
        kind, text, summary = make_contract(random.Random(seed))
        out.append({"doc_id": f"{split}-{i:06d}", "kind": kind, "contract": text, "summary": summary,
                    "prompt": PROMPT.format(contract=text)})
    return out
