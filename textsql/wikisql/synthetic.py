"""Generate WikiSQL-format questions and tables (the original release layout) for demos and tests, offline."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from textsql.errors import TextsqlError
from textsql.wikisql.format import AGG_OPS, COND_OPS

RELEASE_SPLITS = ("train", "dev", "test")
MIN_ROWS, MAX_ROWS = 5, 20

# Roughly WikiSQL's shape: most questions have no aggregation and one condition.
AGG_WEIGHTS = {"": 0.70, "COUNT": 0.10, "MAX": 0.05, "MIN": 0.05, "SUM": 0.04, "AVG": 0.06}
CONDITION_COUNT_WEIGHTS = {1: 0.68, 2: 0.25, 3: 0.05, 4: 0.02}
REAL_OP_WEIGHTS = {"=": 0.6, ">": 0.2, "<": 0.2}

# --------------------------------------------------------------------------- vocabularies

FIRST_NAMES = (
    "John",
    "Mary",
    "James",
    "Patricia",
    "Robert",
    "Linda",
    "Michael",
    "Barbara",
    "William",
    "Elizabeth",
    "David",
    "Jennifer",
    "Richard",
    "Maria",
    "Charles",
    "Susan",
    "Joseph",
    "Margaret",
    "Thomas",
    "Dorothy",
    "Christopher",
    "Lisa",
    "Daniel",
    "Nancy",
    "Paul",
    "Karen",
    "Mark",
    "Betty",
    "Donald",
    "Helen",
    "George",
    "Sandra",
    "Kenneth",
    "Donna",
    "Steven",
    "Carol",
    "Edward",
    "Ruth",
    "Brian",
    "Sharon",
    "Ronald",
    "Michelle",
    "Anthony",
    "Laura",
    "Kevin",
    "Sarah",
    "Jason",
    "Kimberly",
    "Matt",
    "Deborah",
    "Gary",
    "Jessica",
    "Timothy",
    "Shirley",
    "Jose",
    "Cynthia",
    "Larry",
    "Angela",
    "Jeffrey",
    "Melissa",
    "Frank",
    "Brenda",
    "Scott",
    "Amy",
    "Eric",
    "Anna",
    "Stephen",
    "Rebecca",
    "Andrew",
    "Virginia",
    "Raymond",
    "Kathleen",
    "Gregory",
    "Pamela",
    "Joshua",
    "Martha",
    "Jerry",
    "Debra",
    "Dennis",
    "Amanda",
    "Walter",
    "Stephanie",
    "Patrick",
    "Carolyn",
    "Peter",
    "Christine",
    "Harold",
    "Marie",
    "Douglas",
    "Janet",
    "Henry",
    "Catherine",
    "Carl",
    "Frances",
    "Arthur",
    "Ann",
    "Ryan",
    "Joyce",
    "Roger",
    "Diane",
    "Juan",
    "Luis",
    "Carlos",
    "Miguel",
    "Pedro",
    "Hans",
    "Klaus",
    "Pierre",
    "Jean",
    "François",
    "Giovanni",
    "Marco",
    "Luca",
    "Sven",
    "Lars",
    "Erik",
    "Yuki",
    "Hiroshi",
    "Kenji",
    "Ivan",
    "Dmitri",
    "Sergei",
    "Olga",
    "Elena",
    "Ahmed",
    "Omar",
    "Rafael",
    "Andrés",
    "Mats",
    "Björn",
)
LAST_NAMES = (
    "Smith",
    "Johnson",
    "Williams",
    "Brown",
    "Jones",
    "Miller",
    "Davis",
    "Garcia",
    "Rodriguez",
    "Wilson",
    "Martinez",
    "Anderson",
    "Taylor",
    "Thomas",
    "Hernandez",
    "Moore",
    "Martin",
    "Jackson",
    "Thompson",
    "White",
    "Lopez",
    "Lee",
    "Gonzalez",
    "Harris",
    "Clark",
    "Lewis",
    "Robinson",
    "Walker",
    "Perez",
    "Hall",
    "Young",
    "Allen",
    "Sanchez",
    "Wright",
    "King",
    "Scott",
    "Green",
    "Baker",
    "Adams",
    "Nelson",
    "Hill",
    "Ramirez",
    "Campbell",
    "Mitchell",
    "Roberts",
    "Carter",
    "Phillips",
    "Evans",
    "Turner",
    "Torres",
    "Parker",
    "Collins",
    "Edwards",
    "Stewart",
    "Flores",
    "Morris",
    "Nguyen",
    "Murphy",
    "Rivera",
    "Cook",
    "Rogers",
    "Morgan",
    "Peterson",
    "Cooper",
    "Reed",
    "Bailey",
    "Bell",
    "Gomez",
    "Kelly",
    "Howard",
    "Ward",
    "Cox",
    "Diaz",
    "Richardson",
    "Wood",
    "Watson",
    "Brooks",
    "Bennett",
    "Gray",
    "James",
    "Reyes",
    "Cruz",
    "Hughes",
    "Price",
    "Myers",
    "Long",
    "Foster",
    "Sanders",
    "Ross",
    "Morales",
    "Powell",
    "Sullivan",
    "Russell",
    "Ortiz",
    "Jenkins",
    "Gutierrez",
    "Perry",
    "Butler",
    "Barnes",
    "Fisher",
    "Müller",
    "Schmidt",
    "Schneider",
    "Fischer",
    "Weber",
    "Dubois",
    "Moreau",
    "Laurent",
    "Rossi",
    "Russo",
    "Ferrari",
    "Esposito",
    "Andersson",
    "Johansson",
    "Karlsson",
    "Nilsson",
    "Tanaka",
    "Suzuki",
    "Watanabe",
    "Ivanov",
    "Petrov",
    "Smirnov",
    "O'Brien",
    "O'Connor",
    "McDonald",
    "MacLeod",
    "Van der Berg",
    "De Jong",
    "Novák",
    "Kowalski",
)
CITIES = (
    "London",
    "Paris",
    "Berlin",
    "Madrid",
    "Rome",
    "Vienna",
    "Prague",
    "Warsaw",
    "Budapest",
    "Lisbon",
    "Dublin",
    "Amsterdam",
    "Brussels",
    "Stockholm",
    "Oslo",
    "Helsinki",
    "Copenhagen",
    "Athens",
    "Istanbul",
    "Moscow",
    "New York",
    "Los Angeles",
    "Chicago",
    "Houston",
    "Phoenix",
    "Philadelphia",
    "San Antonio",
    "San Diego",
    "Dallas",
    "Boston",
    "Seattle",
    "Denver",
    "Atlanta",
    "Miami",
    "Detroit",
    "Toronto",
    "Montreal",
    "Vancouver",
    "Mexico City",
    "Buenos Aires",
    "São Paulo",
    "Rio de Janeiro",
    "Santiago",
    "Lima",
    "Bogotá",
    "Tokyo",
    "Osaka",
    "Seoul",
    "Beijing",
    "Shanghai",
    "Hong Kong",
    "Singapore",
    "Bangkok",
    "Mumbai",
    "Delhi",
    "Sydney",
    "Melbourne",
    "Auckland",
    "Cairo",
    "Johannesburg",
    "Springfield",
    "Fairview",
    "Franklin",
    "Greenville",
    "Bristol",
    "Clinton",
    "Georgetown",
    "Salem",
    "Madison",
    "Oxford",
)
COUNTRIES = (
    "United States",
    "Canada",
    "Mexico",
    "Brazil",
    "Argentina",
    "Chile",
    "Colombia",
    "Peru",
    "United Kingdom",
    "Ireland",
    "France",
    "Germany",
    "Italy",
    "Spain",
    "Portugal",
    "Netherlands",
    "Belgium",
    "Switzerland",
    "Austria",
    "Sweden",
    "Norway",
    "Denmark",
    "Finland",
    "Poland",
    "Czech Republic",
    "Hungary",
    "Greece",
    "Turkey",
    "Russia",
    "Ukraine",
    "Japan",
    "China",
    "South Korea",
    "India",
    "Thailand",
    "Indonesia",
    "Australia",
    "New Zealand",
    "South Africa",
    "Egypt",
    "Nigeria",
    "Kenya",
    "Morocco",
    "Israel",
    "Iran",
    "Saudi Arabia",
    "Vietnam",
    "Philippines",
    "Malaysia",
    "Cuba",
)
STATES = (
    "Alabama",
    "Arizona",
    "California",
    "Colorado",
    "Florida",
    "Georgia",
    "Illinois",
    "Indiana",
    "Iowa",
    "Kansas",
    "Kentucky",
    "Louisiana",
    "Maryland",
    "Michigan",
    "Minnesota",
    "Missouri",
    "New Jersey",
    "New York",
    "North Carolina",
    "Ohio",
    "Oregon",
    "Pennsylvania",
    "South Carolina",
    "Tennessee",
    "Texas",
    "Virginia",
    "Washington",
    "Wisconsin",
)
TEAM_NICKNAMES = (
    "Eagles",
    "Tigers",
    "Lions",
    "Bears",
    "Wolves",
    "Hawks",
    "Falcons",
    "Panthers",
    "Rangers",
    "Rovers",
    "United",
    "City",
    "Athletic",
    "Warriors",
    "Knights",
    "Pirates",
    "Giants",
    "Rockets",
    "Comets",
    "Stallions",
)
TITLE_ADJECTIVES = (
    "Dark",
    "Silent",
    "Golden",
    "Broken",
    "Last",
    "Lost",
    "Hidden",
    "Burning",
    "Endless",
    "Wild",
    "Crimson",
    "Frozen",
    "Secret",
    "Distant",
    "Little",
    "Second",
    "Empty",
    "Bright",
    "Fallen",
    "Restless",
)
TITLE_NOUNS = (
    "River",
    "Night",
    "Heart",
    "Road",
    "Storm",
    "Dream",
    "City",
    "Garden",
    "Shadow",
    "Fire",
    "Summer",
    "Winter",
    "Kingdom",
    "Promise",
    "Mirror",
    "Island",
    "Horizon",
    "Letter",
    "Stranger",
    "Journey",
    "Harbor",
    "Voice",
    "Ghost",
    "Game",
    "Truth",
    "Memory",
    "Bridge",
    "Sky",
    "Door",
    "Song",
)
MONTHS = (
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
)
UNIVERSITIES = (
    "Duke",
    "Kentucky",
    "UCLA",
    "North Carolina",
    "Kansas",
    "Michigan State",
    "Syracuse",
    "Georgetown",
    "Arizona",
    "Indiana",
    "Villanova",
    "Connecticut",
    "Louisville",
    "Texas",
    "Florida",
    "Ohio State",
    "Memphis",
    "Wake Forest",
    "Stanford",
    "Iowa State",
)
ORDINALS = ("1st", "2nd", "3rd", "4th", "5th", "6th", "7th", "8th", "9th", "10th", "11th", "12th")

# --------------------------------------------------------------------------- cell generators

Cell = str | int | float
CellMaker = Callable[[random.Random, "RowContext"], Cell]


@dataclass
class RowContext:
    """Where a cell is being made: its row number, and per-table constants (start numbers, spelling style)."""

    index: int
    table_state: dict = field(default_factory=dict)

    def constant(self, key: object, make: Callable[[], object]):
        """A value drawn once per table (the same for every row)."""
        if key not in self.table_state:
            self.table_state[key] = make()
        return self.table_state[key]


def pick(*choices: Cell) -> CellMaker:
    return lambda rng, ctx: rng.choice(choices)


def integer(low: int, high: int) -> CellMaker:
    return lambda rng, ctx: rng.randint(low, high)


def decimal(low: float, high: float, places: int = 1) -> CellMaker:
    return lambda rng, ctx: round(rng.uniform(low, high), places)


def counter(first_low: int, first_high: int, steps: tuple[int, ...] = (1,)) -> CellMaker:
    """Numbers that go up row by row from a per-table start (episode numbers, rounds, election years)."""
    key = object()

    def make(rng: random.Random, ctx: RowContext) -> int:
        start, step = ctx.constant(key, lambda: (rng.randint(first_low, first_high), rng.choice(steps)))
        return start + ctx.index * step

    return make


def cased(*choices: str) -> CellMaker:
    """A categorical value spelled as given or lower-cased, per table: 'Won' in one table, 'won' in another."""
    key = object()

    def make(rng: random.Random, ctx: RowContext) -> str:
        lower = ctx.constant(key, lambda: rng.random() < 0.3)
        value = rng.choice(choices)
        return value.lower() if lower else value

    return make


def compose(template: str, **parts: CellMaker) -> CellMaker:
    """Format a template from other generators: compose('{city} Tigers', city=pick(*CITIES))."""
    return lambda rng, ctx: template.format(**{name: part(rng, ctx) for name, part in parts.items()})


def person() -> CellMaker:
    return lambda rng, ctx: f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}"


def title() -> CellMaker:
    def make(rng: random.Random, ctx: RowContext) -> str:
        shape = rng.random()
        if shape < 0.4:
            return f"The {rng.choice(TITLE_ADJECTIVES)} {rng.choice(TITLE_NOUNS)}"
        if shape < 0.7:
            return f"{rng.choice(TITLE_NOUNS)} of the {rng.choice(TITLE_NOUNS)}"
        return f"{rng.choice(TITLE_ADJECTIVES)} {rng.choice(TITLE_NOUNS)}"

    return make


def date(first_year: int, last_year: int, with_year: bool = True) -> CellMaker:
    """Dates as text, in one of WikiSQL's spellings per table ('March 5, 1998' or '5 March 1998')."""
    key = object()

    def make(rng: random.Random, ctx: RowContext) -> str:
        day_first = ctx.constant(key, lambda: rng.random() < 0.3)
        month, day = rng.choice(MONTHS), rng.randint(1, 28)
        text = f"{day} {month}" if day_first else f"{month} {day}"
        if not with_year:
            return text
        year = rng.randint(first_year, last_year)
        return f"{text} {year}" if day_first else f"{text}, {year}"

    return make


def season_span(first_low: int, first_high: int) -> CellMaker:
    """Seasons such as '1995–96', one per row in order."""
    years = counter(first_low, first_high)

    def make(rng: random.Random, ctx: RowContext) -> str:
        year = years(rng, ctx)
        return f"{year}–{(year + 1) % 100:02d}"

    return make


def year_range() -> CellMaker:
    def make(rng: random.Random, ctx: RowContext) -> str:
        start = rng.randint(1980, 2010)
        return f"{start}–{(start + rng.randint(1, 6)) % 100:02d}" if rng.random() < 0.8 else str(start)

    return make


def tennis_score() -> CellMaker:
    def one_set(rng: random.Random) -> str:
        return rng.choice(("6–3", "6–4", "6–2", "7–5", "7–6", "6–1", "3–6", "4–6", "6–0", "5–7", "6–7"))

    return lambda rng, ctx: ", ".join(one_set(rng) for _ in range(rng.choice((2, 2, 3))))


def game_score() -> CellMaker:
    def make(rng: random.Random, ctx: RowContext) -> str:
        ours, theirs = rng.randint(80, 125), rng.randint(80, 125)
        if ours == theirs:
            ours += 1
        overtime = " (OT)" if rng.random() < 0.1 else ""
        return f"{'W' if ours > theirs else 'L'} {ours}–{theirs}{overtime}"

    return make


def football_result() -> CellMaker:
    def make(rng: random.Random, ctx: RowContext) -> str:
        ours, theirs = rng.randint(0, 45), rng.randint(0, 45)
        return f"{'W' if ours > theirs else 'L' if ours < theirs else 'T'} {ours}–{theirs}"

    return make


def win_loss(high: int = 40) -> CellMaker:
    return lambda rng, ctx: f"{rng.randint(0, high)}–{rng.randint(0, high)}"


def candidates() -> CellMaker:
    """US House 'Candidates' cells: 'John Smith (D) 55.3% Mary Jones (R) 44.7%' or 'John Smith (R) Unopposed'."""

    def make(rng: random.Random, ctx: RowContext) -> str:
        winner, loser = person()(rng, ctx), person()(rng, ctx)
        parties = rng.choice((("D", "R"), ("R", "D")))
        if rng.random() < 0.2:
            return f"{winner} ({parties[0]}) Unopposed"
        share = round(rng.uniform(50.1, 85.0), 1)
        return f"{winner} ({parties[0]}) {share}% {loser} ({parties[1]}) {round(100 - share, 1)}%"

    return make


def player_points() -> CellMaker:
    return lambda rng, ctx: f"{rng.choice(LAST_NAMES)} ({rng.randint(4, 45)})"


def arena_attendance() -> CellMaker:
    return lambda rng, ctx: f"{rng.choice(CITIES)} Arena {rng.randint(8000, 21000):,}"


def team() -> CellMaker:
    return lambda rng, ctx: f"{rng.choice(CITIES)} {rng.choice(TEAM_NICKNAMES)}"


# --------------------------------------------------------------------------- table domains


@dataclass(frozen=True)
class Column:
    """One column of a domain: header spellings (a table uses one), type, cell generator."""

    names: tuple[str, ...]
    kind: str  # "text" or "real", as in the release's `types`
    cells: CellMaker
    unique: bool = False  # values differ between rows (names, titles)
    optional: bool = False  # some tables of the domain leave it out
    people: bool = False  # holds people, so questions may ask "Who ..."


def text(*names: str, cells: CellMaker, **flags) -> Column:
    return Column(tuple(names), "text", cells, **flags)


def real(*names: str, cells: CellMaker, **flags) -> Column:
    return Column(tuple(names), "real", cells, **flags)


@dataclass(frozen=True)
class Domain:
    """A kind of Wikipedia table: its columns and how its page and section are titled."""

    name: str
    columns: tuple[Column, ...]
    page_title: CellMaker
    section_titles: tuple[str, ...]


DOMAINS = (
    Domain(
        "tv_episodes",
        (
            real("No. in series", "Series #", cells=counter(1, 150)),
            real("No. in season", "Episode #", cells=counter(1, 1)),
            text("Title", "Episode title", cells=compose('"{t}"', t=title()), unique=True),
            text("Directed by", "Director", cells=person(), people=True),
            text("Written by", "Writer(s)", cells=person(), people=True),
            text("Original air date", "Airdate", cells=date(1990, 2012)),
            real("U.S. viewers (millions)", "Viewers (millions)", cells=decimal(2.0, 25.0, 2), optional=True),
            text(
                "Production code",
                "Prod. code",
                cells=compose("{a}{b}{c}", a=integer(1, 6), b=pick("T", "X", "AB", "K"), c=integer(1000, 9999)),
                unique=True,
                optional=True,
            ),
        ),
        compose("List of {a} {b} episodes", a=pick(*TITLE_ADJECTIVES), b=pick(*TITLE_NOUNS)),
        ("Season 1", "Season 2", "Season 3", "Season 4", "Episodes"),
    ),
    Domain(
        "football_seasons",
        (
            text("Season", "Year", cells=season_span(1960, 2005)),
            text(
                "Division",
                "League",
                cells=pick(
                    "Premier League", "First Division", "Second Division", "Championship", "League One", "Conference"
                ),
            ),
            real("Pos.", "Position", cells=integer(1, 24)),
            real("Pld", "Played", cells=integer(30, 46)),
            real("W", "Won", cells=integer(5, 30)),
            real("D", "Drawn", cells=integer(2, 18)),
            real("L", "Lost", cells=integer(2, 25)),
            real("GF", "Goals for", cells=integer(25, 100), optional=True),
            real("GA", "Goals against", cells=integer(20, 95), optional=True),
            real("Pts", "Points", cells=integer(20, 100)),
            text("Top scorer", "Leading goalscorer", cells=person(), people=True, optional=True),
            text(
                "FA Cup",
                "Cup",
                cells=cased("Winners", "Runners-up", "Semi-final", "Quarter-final", "Third round", "Fourth round"),
                optional=True,
            ),
        ),
        compose("{city} {nick} F.C. seasons", city=pick(*CITIES), nick=pick(*TEAM_NICKNAMES)),
        ("Seasons", "League history", "Record by season"),
    ),
    Domain(
        "rugby_clubs",
        (
            text("Club", cells=compose("{town} RFC", town=pick(*CITIES)), unique=True),
            real("Played", cells=integer(18, 22)),
            real("Won", cells=integer(0, 22)),
            real("Drawn", cells=integer(0, 4)),
            real("Lost", cells=integer(0, 22)),
            real("Points for", cells=integer(150, 800)),
            real("Points against", cells=integer(150, 800)),
            real("Tries for", cells=integer(10, 110), optional=True),
            real("Tries against", cells=integer(10, 110), optional=True),
            real("Try bonus", cells=integer(0, 15), optional=True),
            real("Points", cells=integer(5, 100)),
        ),
        compose(
            "WRU Division {n} {region}",
            n=pick("One", "Two", "Three", "Four"),
            region=pick("East", "West", "North", "South"),
        ),
        ("League table", "Final standings", "Table"),
    ),
    Domain(
        "house_elections",
        (
            text("District", cells=compose("{state} {n}", state=pick(*STATES), n=integer(1, 25)), unique=True),
            text("Incumbent", "Representative", cells=person(), people=True),
            text("Party", cells=cased("Democratic", "Republican", "Democratic", "Republican", "Independent")),
            real("First elected", cells=integer(1940, 2008)),
            text(
                "Result",
                "Status",
                cells=pick(
                    "Re-elected",
                    "Re-elected",
                    "Retired Republican hold",
                    "Retired Democratic hold",
                    "Lost re-election Republican gain",
                    "Lost re-election Democratic gain",
                ),
            ),
            text("Candidates", cells=candidates()),
        ),
        compose("United States House of Representatives elections, {year}", year=integer(1950, 2010)),
        ("Results", "Election results", "Races"),
    ),
    Domain(
        "film_awards",
        (
            real("Year", cells=integer(1960, 2015)),
            text(
                "Award",
                "Association",
                cells=pick(
                    "Academy Award",
                    "Golden Globe Award",
                    "BAFTA Award",
                    "Screen Actors Guild Award",
                    "Saturn Award",
                    "Critics' Choice Award",
                    "Emmy Award",
                ),
            ),
            text(
                "Category",
                cells=pick(
                    "Best Actor",
                    "Best Actress",
                    "Best Supporting Actor",
                    "Best Supporting Actress",
                    "Best Director",
                    "Best Film",
                    "Best Original Screenplay",
                    "Outstanding Performance",
                ),
            ),
            text("Nominated work", "Film", cells=title()),
            text("Result", "Outcome", cells=cased("Won", "Nominated", "Nominated")),
            real("Ceremony", "No.", cells=integer(30, 90), optional=True),
        ),
        compose("List of awards and nominations received by {name}", name=person()),
        ("Awards and nominations", "Film", "Television"),
    ),
    Domain(
        "filmography",
        (
            real("Year", cells=integer(1955, 2015)),
            text("Title", "Film", cells=title(), unique=True),
            text(
                "Role",
                "Character",
                cells=pick(
                    "Himself",
                    "Herself",
                    "Narrator",
                    "Detective",
                    "Doctor",
                    "The King",
                    "Captain",
                    "Young woman",
                    "Agent",
                    "Professor",
                ),
            ),
            text("Director", "Directed by", cells=person(), people=True),
            real("Box office (millions)", "Gross (US$ millions)", cells=decimal(0.5, 900.0, 1), optional=True),
            text(
                "Notes",
                cells=pick("Lead role", "Cameo", "Voice role", "Uncredited", "Television film", "Supporting role"),
                optional=True,
            ),
            text(
                "Studio",
                "Distributor",
                cells=pick(
                    "Paramount",
                    "Warner Bros.",
                    "Universal",
                    "20th Century Fox",
                    "Columbia",
                    "MGM",
                    "Miramax",
                    "Lionsgate",
                ),
            ),
        ),
        compose("{name} filmography", name=person()),
        ("Film", "Filmography", "Selected filmography"),
    ),
    Domain(
        "countries",
        (
            text("Country", "Nation", cells=pick(*COUNTRIES), unique=True),
            text("Capital", "Largest city", cells=pick(*CITIES), unique=True),
            real("Population", "Population (2010)", cells=integer(50_000, 90_000_000)),
            real("Area (km²)", "Area (sq mi)", cells=integer(300, 9_000_000)),
            real("GDP per capita (US$)", "GDP per capita", cells=integer(400, 85_000), optional=True),
            real("Density (per km²)", "Pop. density", cells=decimal(1.0, 1200.0, 1), optional=True),
            text(
                "Region",
                "Continent",
                cells=cased("Europe", "Asia", "Africa", "North America", "South America", "Oceania"),
            ),
            text(
                "Official language(s)",
                "Language",
                cells=pick(
                    "English",
                    "French",
                    "Spanish",
                    "German",
                    "Portuguese",
                    "Arabic",
                    "Russian",
                    "Japanese",
                    "English, French",
                ),
            ),
        ),
        compose(
            "List of countries by {thing}", thing=pick("population", "area", "GDP", "population density", "region")
        ),
        ("Sovereign states", "List", "Countries", "By region"),
    ),
    Domain(
        "cars",
        (
            text(
                "Model",
                "Name",
                cells=compose(
                    "{make} {name}",
                    make=pick(
                        "Ford",
                        "Toyota",
                        "Honda",
                        "BMW",
                        "Audi",
                        "Fiat",
                        "Volvo",
                        "Nissan",
                        "Opel",
                        "Peugeot",
                        "Mazda",
                        "Saab",
                    ),
                    name=pick(
                        "GT",
                        "Sport",
                        "Coupé",
                        "Estate",
                        "1600",
                        "2000",
                        "Turbo",
                        "Classic",
                        "Roadster",
                        "Deluxe",
                        "LX",
                        "SE",
                    ),
                ),
                unique=True,
            ),
            real("Year", "Year introduced", cells=integer(1960, 2015)),
            text(
                "Engine",
                cells=compose(
                    "{d}L {c}",
                    d=pick("1.0", "1.2", "1.4", "1.6", "1.8", "2.0", "2.5", "3.0", "4.2"),
                    c=pick("I3", "I4", "V6", "V8", "flat-4", "I4 turbo"),
                ),
            ),
            real("Power (hp)", "Power", cells=integer(55, 600)),
            real("Torque (N·m)", "Torque", cells=integer(90, 800), optional=True),
            real("0–100 km/h (s)", "Acceleration 0–100km/h", cells=decimal(3.0, 16.0, 1), optional=True),
            real("Top speed (km/h)", "Top speed", cells=integer(140, 340)),
            text(
                "Body style",
                "Body",
                cells=pick("Sedan", "Hatchback", "Coupé", "Convertible", "Estate", "SUV", "Pickup"),
            ),
        ),
        compose(
            "{make} {kind}",
            make=pick("Ford", "Toyota", "BMW", "Fiat", "Volvo", "Opel"),
            kind=pick("model history", "engines", "vehicles"),
        ),
        ("Models", "Specifications", "Engines"),
    ),
    Domain(
        "albums",
        (
            real("Year", cells=integer(1960, 2015)),
            text("Album", "Title", cells=title(), unique=True),
            text(
                "Label",
                "Record label",
                cells=pick(
                    "Columbia", "Epic", "Atlantic", "Capitol", "Island", "Def Jam", "Sub Pop", "Motown", "Virgin", "EMI"
                ),
            ),
            real("US", "Peak chart position (US)", cells=integer(1, 200)),
            real("UK", "Peak chart position (UK)", cells=integer(1, 100), optional=True),
            text(
                "Certification",
                "Certifications",
                cells=cased("Gold", "Platinum", "2× Platinum", "Silver", "Diamond", "Gold"),
            ),
            text(
                "Format",
                "Formats",
                cells=pick("CD", "LP", "CD, LP", "Digital download", "Cassette", "CD, digital download"),
                optional=True,
            ),
        ),
        compose("{name} discography", name=person()),
        ("Studio albums", "Albums", "Compilation albums", "Live albums"),
    ),
    Domain(
        "schools",
        (
            text("School", cells=compose("{n} High School", n=pick(*(LAST_NAMES + CITIES))), unique=True),
            text("Location", "City", cells=pick(*CITIES)),
            text("Mascot", "Nickname", cells=pick(*TEAM_NICKNAMES)),
            real("Enrollment", "Enrolment", cells=integer(150, 3500)),
            real("Founded", "Year founded", cells=integer(1850, 2005)),
            text("Type", "Affiliation", cells=cased("Public", "Private", "Catholic", "Public")),
            text("County", cells=compose("{n} {name}", n=integer(1, 92), name=pick(*LAST_NAMES)), optional=True),
            text("IHSAA Class", "Class", cells=pick("AAAA", "AAA", "AA", "A"), optional=True),
        ),
        compose("List of high schools in {state}", state=pick(*STATES)),
        ("Public schools", "Private schools", "Schools", "Current members"),
    ),
    Domain(
        "grand_prix",
        (
            real("Rd.", "Round", cells=counter(1, 1)),
            text("Grand Prix", "Race", cells=compose("{c} Grand Prix", c=pick(*COUNTRIES)), unique=True),
            text("Circuit", "Location", cells=pick(*CITIES)),
            text("Date", cells=date(1970, 2012, with_year=False)),
            text("Pole position", "Pole Position", cells=person(), people=True),
            text("Fastest lap", "Fastest Lap", cells=person(), people=True, optional=True),
            text("Winning driver", "Winner", cells=person(), people=True),
            text(
                "Constructor",
                "Winning constructor",
                cells=pick(
                    "Ferrari", "McLaren", "Williams", "Lotus", "Brabham", "Renault", "Benetton", "Tyrrell", "Red Bull"
                ),
            ),
            text("Report", cells=pick("Report"), optional=True),
        ),
        compose("{year} Formula One season", year=integer(1960, 2012)),
        ("Grands Prix", "Season review", "Results"),
    ),
    Domain(
        "roster",
        (
            text("Player", cells=person(), unique=True, people=True),
            real("No.", "Number", cells=integer(0, 55)),
            text(
                "Nationality",
                cells=pick(
                    "United States",
                    "Canada",
                    "France",
                    "Spain",
                    "Serbia",
                    "Lithuania",
                    "Argentina",
                    "Australia",
                    "Nigeria",
                    "Greece",
                ),
            ),
            text(
                "Position",
                cells=cased(
                    "Guard", "Forward", "Center", "Guard-Forward", "Forward-Center", "Point guard", "Shooting guard"
                ),
            ),
            text("Years in Toronto", "Years", cells=year_range()),
            text("School/Club Team", "College", cells=pick(*UNIVERSITIES)),
            real("Height (m)", "Height", cells=decimal(1.75, 2.24, 2), optional=True),
        ),
        compose("{city} {nick} all-time roster", city=pick(*CITIES), nick=pick(*TEAM_NICKNAMES)),
        ("A", "B", "C", "D", "Players", "Roster"),
    ),
    Domain(
        "tennis_finals",
        (
            text("Outcome", cells=cased("Winner", "Runner-up")),
            real("No.", cells=counter(1, 1)),
            text("Date", "Year", cells=date(1975, 2012)),
            text(
                "Tournament",
                "Championship",
                cells=compose("{city}, {country}", city=pick(*CITIES), country=pick(*COUNTRIES)),
            ),
            text("Surface", cells=cased("Hard", "Clay", "Grass", "Carpet", "Hard (i)")),
            text("Opponent", "Opponent in the final", cells=person(), people=True),
            text("Score", "Score in the final", cells=tennis_score()),
        ),
        compose("{name} career statistics", name=person()),
        ("Singles: finals", "Doubles: finals", "Career finals"),
    ),
    Domain(
        "davis_cup",
        (
            text("Player", cells=person(), unique=True, people=True),
            text("Total W–L", "Overall W–L", cells=win_loss(40)),
            text("Singles W–L", cells=win_loss(30)),
            text("Doubles W–L", cells=win_loss(20)),
            real("Ties", cells=integer(1, 45)),
            real("Debut", "First year", cells=integer(1950, 2012)),
            real("Years played", "Years", cells=integer(1, 15)),
        ),
        compose("{country} Davis Cup team", country=pick(*COUNTRIES)),
        ("Players", "Current team", "Team records"),
    ),
    Domain(
        "medal_table",
        (
            real("Rank", cells=counter(1, 1)),
            text("Nation", "Country", cells=pick(*COUNTRIES), unique=True),
            real("Gold", cells=integer(0, 40)),
            real("Silver", cells=integer(0, 40)),
            real("Bronze", cells=integer(0, 40)),
            real("Total", cells=integer(1, 110)),
        ),
        compose(
            "{event} at the {year} {games}",
            event=pick("Athletics", "Swimming", "Rowing", "Fencing", "Judo", "Cycling"),
            year=integer(1952, 2012),
            games=pick("Summer Olympics", "Asian Games", "Commonwealth Games", "Pan American Games"),
        ),
        ("Medal table", "Medal summary", "Medals"),
    ),
    Domain(
        "nba_game_log",
        (
            real("Game", cells=counter(1, 70)),
            text("Date", cells=date(1990, 2012, with_year=False)),
            text("Team", "Opponent", cells=team()),
            text("Score", cells=game_score()),
            text("High points", cells=player_points()),
            text("High rebounds", cells=player_points(), optional=True),
            text("High assists", cells=player_points(), optional=True),
            text("Location Attendance", cells=arena_attendance()),
            text("Record", cells=win_loss(60)),
        ),
        compose(
            "{year}–{next:02d} {city} {nick} season",
            year=integer(1990, 2011),
            next=integer(0, 99),
            city=pick(*CITIES),
            nick=pick(*TEAM_NICKNAMES),
        ),
        ("Game log", "Regular season", "Playoffs"),
    ),
    Domain(
        "nfl_schedule",
        (
            real("Week", cells=counter(1, 1)),
            text("Date", cells=date(1960, 2012)),
            text("Opponent", cells=compose("{at}{t}", at=pick("", "at "), t=team())),
            text("Result", cells=football_result()),
            real("Attendance", cells=integer(20_000, 80_000)),
            text("Game site", "Venue", cells=compose("{c} Stadium", c=pick(*CITIES)), optional=True),
            text("Record", cells=win_loss(16), optional=True),
        ),
        compose(
            "{year} {city} {nick} season", year=integer(1960, 2012), city=pick(*CITIES), nick=pick(*TEAM_NICKNAMES)
        ),
        ("Schedule", "Regular season", "Season schedule"),
    ),
    Domain(
        "buildings",
        (
            real("Rank", cells=counter(1, 1)),
            text(
                "Name",
                "Building",
                cells=compose(
                    "{n} {kind}",
                    n=pick(*(LAST_NAMES + CITIES)),
                    kind=pick("Tower", "Center", "Plaza", "Building", "Place", "House"),
                ),
                unique=True,
            ),
            text("City", "Location", cells=pick(*CITIES)),
            text("Height ft (m)", "Height", cells=compose("{ft} ({m})", ft=integer(300, 1500), m=integer(90, 460))),
            real("Floors", cells=integer(20, 120)),
            real("Year", "Year completed", cells=integer(1900, 2012)),
        ),
        compose("List of tallest buildings in {city}", city=pick(*CITIES)),
        ("Tallest buildings", "Completed", "Timeline of tallest buildings"),
    ),
    Domain(
        "companies",
        (
            real("Rank", cells=counter(1, 1)),
            text(
                "Company",
                cells=compose(
                    "{n} {kind}",
                    n=pick(*LAST_NAMES),
                    kind=pick("Group", "Holdings", "Corporation", "Industries", "Bank", "Motors", "Energy", "Foods"),
                ),
                unique=True,
            ),
            text("Headquarters", cells=pick(*COUNTRIES)),
            text(
                "Industry",
                cells=pick(
                    "Banking",
                    "Oil and gas",
                    "Automotive",
                    "Retail",
                    "Conglomerate",
                    "Telecommunications",
                    "Insurance",
                    "Pharmaceuticals",
                ),
            ),
            real("Sales (billion $)", "Revenue (billion $)", cells=decimal(5.0, 450.0, 1)),
            real("Profits (billion $)", "Profit (billion $)", cells=decimal(0.5, 45.0, 2)),
            real("Assets (billion $)", cells=decimal(10.0, 2500.0, 1), optional=True),
            real("Market Value (billion $)", "Market value", cells=decimal(5.0, 450.0, 1), optional=True),
        ),
        compose("Forbes Global {n}", n=pick("2000", "500", "100")),
        ("List", "Top companies", "{year} list"),
    ),
    Domain(
        "party_results",
        (
            real("Election", "Year", cells=counter(1945, 1950, (2, 3, 4))),
            text("Party leader", "Leader", cells=person(), people=True),
            real("Votes", "# of votes", cells=integer(10_000, 9_000_000)),
            real("% of vote", "% of popular vote", cells=decimal(0.5, 55.0, 1)),
            real("Seats", "# of seats won", cells=integer(0, 350)),
            text("Position", cells=pick(*ORDINALS[:6])),
            text("Government", "Status", cells=cased("Government", "Opposition", "Coalition", "Extra-parliamentary")),
        ),
        compose(
            "{name} Party ({country})",
            name=pick("Liberal", "Conservative", "Labour", "Green", "Social Democratic", "People's", "Progressive"),
            country=pick(*COUNTRIES),
        ),
        ("Electoral history", "Election results", "Parliament"),
    ),
)

# --------------------------------------------------------------------------- questions

# Main clause per aggregation; "clause" conditions follow when/where, "noun" conditions follow with/for/has.
QUESTION_TEMPLATES = {
    "": (
        ("What is the {sel} when {conds}?", "clause"),
        ("What was the {sel} when {conds}?", "clause"),
        ("Which {sel} has {conds}?", "noun"),
        ("Name the {sel} for {conds}", "noun"),
        ("What {sel} has {conds}?", "noun"),
        ("Tell me the {sel} for {conds}", "noun"),
        ("What is the {sel} with {conds}?", "noun"),
        ("What are the {sel} where {conds}?", "clause"),
        ("When {conds}, what is the {sel}?", "clause"),
        ("Give the {sel} that has {conds}.", "noun"),
        ("What {sel} had {conds}?", "noun"),
        ("List the {sel} when {conds}.", "clause"),
        ("what is the {sel} if {conds}", "clause"),
    ),
    "who": (
        ("Who is the {sel} when {conds}?", "clause"),
        ("Who was the {sel} with {conds}?", "noun"),
        ("Who is {sel} for {conds}?", "noun"),
    ),
    "COUNT": (
        ("How many {sel} have {conds}?", "noun"),
        ("What is the total number of {sel} when {conds}?", "clause"),
        ("How many {sel} are there when {conds}?", "clause"),
        ("Count the number of {sel} with {conds}.", "noun"),
        ("Tell me the number of {sel} for {conds}", "noun"),
        ("What is the count of {sel} where {conds}?", "clause"),
    ),
    "MAX": (
        ("What is the highest {sel} with {conds}?", "noun"),
        ("What is the largest {sel} when {conds}?", "clause"),
        ("Name the most {sel} for {conds}", "noun"),
        ("What is the maximum {sel} where {conds}?", "clause"),
        ("Tell me the highest {sel} for {conds}", "noun"),
    ),
    "MIN": (
        ("What is the lowest {sel} with {conds}?", "noun"),
        ("What is the smallest {sel} when {conds}?", "clause"),
        ("Name the least {sel} for {conds}", "noun"),
        ("What is the minimum {sel} where {conds}?", "clause"),
        ("Tell me the lowest {sel} for {conds}", "noun"),
    ),
    "SUM": (
        ("What is the total {sel} when {conds}?", "clause"),
        ("What is the sum of {sel} with {conds}?", "noun"),
        ("Tell me the sum of {sel} for {conds}", "noun"),
        ("What is the sum of the {sel} when {conds}?", "clause"),
        ("How much {sel} in total has {conds}?", "noun"),
    ),
    "AVG": (
        ("What is the average {sel} when {conds}?", "clause"),
        ("Tell me the average {sel} for {conds}", "noun"),
        ("What is the mean {sel} with {conds}?", "noun"),
        ("Name the average {sel} for {conds}", "noun"),
        ("What was the average {sel} where {conds}?", "clause"),
    ),
}

CONDITION_PHRASES = {
    ("clause", "="): ("{col} is {val}", "the {col} is {val}", "{col} was {val}", "{col} equals {val}"),
    ("clause", ">"): (
        "{col} is larger than {val}",
        "the {col} is greater than {val}",
        "{col} is more than {val}",
        "{col} is over {val}",
        "{col} is bigger than {val}",
    ),
    ("clause", "<"): (
        "{col} is less than {val}",
        "the {col} is smaller than {val}",
        "{col} is fewer than {val}",
        "{col} is under {val}",
        "the {col} is lower than {val}",
    ),
    ("noun", "="): ("a {col} of {val}", "{col} of {val}", "the {col} of {val}", "{col} {val}", "{val} as {col}"),
    ("noun", ">"): (
        "a {col} larger than {val}",
        "{col} greater than {val}",
        "a {col} more than {val}",
        "{col} over {val}",
        "a {col} above {val}",
    ),
    ("noun", "<"): (
        "a {col} less than {val}",
        "{col} smaller than {val}",
        "a {col} fewer than {val}",
        "{col} under {val}",
        "a {col} below {val}",
    ),
}
BARE_VALUE_SHARE = 0.15  # "Name the Score for March 5": the column is left for the reader to infer
LOWER_COLUMN_SHARE = 0.2
VALUE_CASE_CHANGE_SHARE = 0.1


def generate_wikisql(
    out_dir: str | Path,
    *,
    train_tables: int = 300,
    dev_tables: int = 60,
    test_tables: int = 60,
    questions_per_table: int = 10,
    seed: int = 0,
) -> Path:
    """Write generated data in the WikiSQL release layout: {train,dev,test}.jsonl and {train,dev,test}.tables.jsonl.

    Each question line is {"phase", "table_id", "question", "sql": {"sel", "agg", "conds": [[col, op, value], ...]}};
    each table line is {"id", "header", "types", "rows", "page_title", "section_title", "caption", "name"}.
    The splits never share a table. Returns out_dir.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for split, num_tables in zip(RELEASE_SPLITS, (train_tables, dev_tables, test_tables)):
        questions, tables = generate_split(split, num_tables, questions_per_table, seed=seed)
        _write_jsonl(out_dir / f"{split}.jsonl", questions)
        _write_jsonl(out_dir / f"{split}.tables.jsonl", tables)
    return out_dir


def generate_split(
    split: str, num_tables: int, questions_per_table: int, *, seed: int = 0
) -> tuple[list[dict], list[dict]]:
    """Questions and tables of one release split ("train", "dev" or "test"), as the release's JSON objects.

    Deterministic for (split, seed); table ids carry the split, so different splits never share a table.
    """
    if split not in RELEASE_SPLITS:
        raise TextsqlError(
            f"Unknown split '{split}': generate one of {', '.join(RELEASE_SPLITS)} (the release calls validation 'dev')."
        )
    if num_tables < 0 or questions_per_table < 1:
        raise TextsqlError("Generate a non-negative number of tables and at least 1 question per table.")
    rng = random.Random(f"textsql-generate-{split}-{seed}")
    questions, tables = [], []
    for table_id in _table_ids(rng, split, num_tables):
        table, columns = generate_table(rng, table_id)
        tables.append(table)
        questions.extend(generate_questions(rng, table, columns, questions_per_table))
    return questions, tables


def _table_ids(rng: random.Random, split: str, count: int) -> list[str]:
    """WikiSQL-style ids ('1-10015132-11'); the middle number's first digit is the split's, so splits never collide."""
    block = (RELEASE_SPLITS.index(split) + 1) * 10_000_000
    middles = rng.sample(range(10_000_000), count)
    return [f"1-{block + middle}-{rng.randint(1, 30)}" for middle in middles]


# --------------------------------------------------------------------------- tables


def generate_table(rng: random.Random, table_id: str) -> tuple[dict, list[Column]]:
    """One table in the release's format, plus the domain columns it was made from (one per header)."""
    domain = rng.choice(DOMAINS)
    columns = _choose_columns(rng, domain)
    num_rows = rng.randint(MIN_ROWS, MAX_ROWS)
    table_state: dict = {}
    cells_by_column = [_column_cells(rng, column, num_rows, table_state) for column in columns]
    page_title = domain.page_title(rng, RowContext(0))
    section_title = rng.choice(domain.section_titles).format(year=rng.randint(1990, 2012))
    middle = table_id.split("-")[1]
    table = {
        "id": table_id,
        "header": [rng.choice(column.names) for column in columns],
        "types": [column.kind for column in columns],
        "rows": [list(row) for row in zip(*cells_by_column)],
        "page_title": page_title,
        "section_title": section_title,
        "caption": rng.choice(("", section_title, page_title)),
        "name": f"table_{middle}_{table_id.split('-')[2]}",
    }
    return table, columns


def _choose_columns(rng: random.Random, domain: Domain) -> list[Column]:
    """The domain's required columns and a random part of its optional ones, in the domain's order."""
    return [column for column in domain.columns if not column.optional or rng.random() < 0.6]


def _column_cells(rng: random.Random, column: Column, num_rows: int, table_state: dict) -> list[Cell]:
    cells: list[Cell] = []
    for index in range(num_rows):
        context = RowContext(index, table_state)
        value = column.cells(rng, context)
        # A few redraws make names and titles distinct; an occasional repeat is harmless.
        for _ in range(20 if column.unique else 0):
            if value not in cells:
                break
            value = column.cells(rng, context)
        cells.append(value)
    return cells


# --------------------------------------------------------------------------- questions


def generate_questions(rng: random.Random, table: dict, columns: list[Column], count: int) -> list[dict]:
    """`count` distinct questions about `table`, each with its structured query, as release question lines."""
    people_columns = {i for i, column in enumerate(columns) if column.people}
    questions, seen = [], set()
    for _ in range(count * 5):  # redraw duplicates; tiny tables may allow fewer distinct questions
        if len(questions) == count:
            break
        sql = _random_sql(rng, table)
        question = _render_question(rng, table, sql, sql["sel"] in people_columns)
        if question in seen:
            continue
        seen.add(question)
        questions.append({"phase": 1, "table_id": table["id"], "question": question, "sql": sql})
    return questions


def _random_sql(rng: random.Random, table: dict) -> dict:
    """A query whose conditions all hold for one randomly chosen row, so it selects at least that row."""
    types, rows = table["types"], table["rows"]
    agg = _weighted(rng, AGG_WEIGHTS)
    real_columns = [i for i, kind in enumerate(types) if kind == "real"]
    if agg in ("", "COUNT") or not real_columns:
        agg = agg if agg in ("", "COUNT") else ""
        sel = rng.randrange(len(types))
    else:
        sel = rng.choice(real_columns)
    candidates = [i for i in range(len(types)) if i != sel]
    num_conds = min(_weighted(rng, CONDITION_COUNT_WEIGHTS), len(candidates))
    anchor = rng.choice(rows)
    conds = [_condition(rng, column, types[column], anchor, rows) for column in rng.sample(candidates, num_conds)]
    return {"sel": sel, "agg": AGG_OPS.index(agg), "conds": conds}


def _condition(rng: random.Random, column: int, kind: str, anchor: list, rows: list[list]) -> list:
    """[column, op, value] that the anchor row satisfies; '>'/'<' compare against another row's value."""
    value = anchor[column]
    op = _weighted(rng, REAL_OP_WEIGHTS) if kind == "real" else "="
    if op != "=":
        others = sorted({row[column] for row in rows if (row[column] < value if op == ">" else row[column] > value)})
        if others:
            return [column, COND_OPS.index(op), rng.choice(others)]
    if kind == "text" and rng.random() < VALUE_CASE_CHANGE_SHARE:
        value = _recased(rng, value)  # users type 'won' for 'Won'; the query keeps what they typed
    return [column, COND_OPS.index("="), value]


def _recased(rng: random.Random, value: str) -> str:
    changed = value.lower() if value != value.lower() else value.title()
    return changed if rng.random() < 0.8 else value.upper()


def _render_question(rng: random.Random, table: dict, sql: dict, sel_is_people: bool) -> str:
    agg = AGG_OPS[sql["agg"]]
    key = "who" if agg == "" and sel_is_people and rng.random() < 0.5 else agg
    template, mode = rng.choice(QUESTION_TEMPLATES[key])
    phrases = [_condition_phrase(rng, table, cond, mode, bare_allowed=(i == 0)) for i, cond in enumerate(sql["conds"])]
    sel = _column_mention(rng, table["header"][sql["sel"]])
    return template.format(sel=sel, conds=_join_phrases(rng, phrases))


def _condition_phrase(rng: random.Random, table: dict, cond: list, mode: str, bare_allowed: bool) -> str:
    column, op, value = cond
    op_text = COND_OPS[op]
    value_text = format_value(value)
    if mode == "noun" and op_text == "=" and bare_allowed and rng.random() < BARE_VALUE_SHARE:
        return value_text
    phrase = rng.choice(CONDITION_PHRASES[(mode, op_text)])
    return phrase.format(col=_column_mention(rng, table["header"][column]), val=value_text)


def _join_phrases(rng: random.Random, phrases: list[str]) -> str:
    if len(phrases) <= 2:
        return " and ".join(phrases)
    last_joiner = rng.choice((" and ", ", and "))
    return ", ".join(phrases[:-1]) + last_joiner + phrases[-1]


def _column_mention(rng: random.Random, header: str) -> str:
    return header.lower() if rng.random() < LOWER_COLUMN_SHARE else header


def format_value(value: Cell) -> str:
    """A cell or condition value as it is written in questions and in human-readable SQL (str of the JSON value)."""
    return str(value)


def _weighted(rng: random.Random, weights: dict):
    return rng.choices(list(weights), weights=list(weights.values()))[0]


def _write_jsonl(path: Path, records: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
