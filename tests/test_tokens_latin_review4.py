"""The rough estimator on Latin-script languages with many accented letters, and on Georgian (review 4).

Latin letters of two UTF-8 bytes were counted at half a token: Polish, Czech, Turkish, Vietnamese,
Romanian and Hungarian text came to 20-35% under cl100k_base's count (an accent splits its word, whose
other letters then tokenize worse too), Georgian (three bytes, a token a letter) to half of it, so a
budget fitted with the estimate overflowed on them. Measured medians over 300-character texts of gettext
catalogs and man pages are in the README; these sentences pin the direction.
"""

from __future__ import annotations

import json

import pytest

from transcript_store.tokens import RoughEstimator

#: sentences and their exact counts in cl100k_base and o200k_base (bpe-openai, tiktoken's ranks)
LANGUAGES = {
    "polish": [
        ("Nie można połączyć się z serwerem. Sprawdź połączenie z internetem i spróbuj ponownie później.", 35, 29),
        ("Plik jest zbyt duży, aby go otworzyć; wybierz "
         "mniejszy plik albo zwiększ dozwolony rozmiar w ustawieniach.", 43, 36),
        ("Źródło dźwięku zostało wyłączone, ponieważ urządzenie przestało odpowiadać.", 29, 23),
    ],
    "czech": [
        ("Nelze se připojit k serveru. Zkontrolujte připojení k internetu a zkuste to znovu později.", 35, 31),
        ("Soubor je příliš velký, než aby jej bylo "
         "možné otevřít; vyberte menší soubor nebo zvětšete povolenou velikost.", 50, 35),
        ("Zvukové zařízení přestalo odpovídat, a proto bylo přehrávání přerušeno.", 33, 23),
    ],
    "turkish": [
        ("Sunucuya bağlanılamıyor. İnternet bağlantınızı kontrol edip daha sonra tekrar deneyin.", 33, 21),  # noqa: RUF001
        ("Dosya açılamayacak kadar büyük; daha küçük bir dosya "  # noqa: RUF001
         "seçin ya da ayarlardan izin verilen boyutu artırın.", 38, 28),  # noqa: RUF001
        ("Ses aygıtı yanıt vermeyi durdurduğu için oynatma kesildi.", 27, 18),  # noqa: RUF001
    ],
    "vietnamese": [
        ("Không thể kết nối với máy chủ. Hãy kiểm tra kết nối mạng và thử lại sau.", 34, 20),
        ("Tệp quá lớn để mở; hãy chọn một tệp nhỏ hơn hoặc tăng kích thước cho phép trong phần cài đặt.", 50, 27),
        ("Thiết bị âm thanh đã ngừng phản hồi nên việc phát lại bị gián đoạn.", 35, 19),
    ],
    "romanian": [
        ("Nu se poate realiza conexiunea la server. Verificați "
         "conexiunea la internet și încercați din nou mai târziu.", 34, 29),
        ("Fișierul este prea mare pentru a fi deschis; alegeți "
         "un fișier mai mic sau măriți dimensiunea permisă în setări.", 41, 35),
        ("Dispozitivul audio a încetat să răspundă, așa că redarea a fost întreruptă.", 31, 26),
    ],
    "hungarian": [
        ("Nem sikerült csatlakozni a kiszolgálóhoz. Ellenőrizze "
         "az internetkapcsolatot, és próbálja újra később.", 44, 35),
        ("A fájl túl nagy ahhoz, hogy megnyitható legyen; válasszon "
         "kisebb fájlt, vagy növelje a megengedett méretet a beállításokban.", 53, 42),
        ("A hangeszköz nem válaszol, ezért a lejátszás megszakadt.", 27, 20),
    ],
    "georgian": [
        ("სერვერთან დაკავშირება ვერ მოხერხდა. შეამოწმეთ ინტერნეტ კავშირი და სცადეთ მოგვიანებით.", 159, 30),
        ("ფაილი ძალიან დიდია გასახსნელად; აირჩიეთ უფრო პატარა ფაილი.", 107, 22),
    ],
    "french": [
        ("Impossible de se connecter au serveur. Vérifiez votre connexion à Internet et réessayez plus tard.", 24, 20),
        ("Le périphérique audio a cessé de répondre, la lecture a donc été interrompue.", 22, 19),
    ],
    "spanish": [
        ("No se puede conectar con el servidor. Compruebe su "
         "conexión a Internet e inténtelo de nuevo más tarde.", 25, 24),
        ("El dispositivo de audio dejó de responder, por lo que se interrumpió la reproducción.", 21, 18),
    ],
    "german": [
        ("Die Verbindung zum Server ist fehlgeschlagen. Überprüfen Sie "
         "Ihre Internetverbindung und versuchen Sie es später erneut.", 29, 24),
        ("Das Audiogerät reagiert nicht mehr, daher wurde die Wiedergabe unterbrochen.", 21, 19),
    ],
}
LESS_ACCENTED = ("french", "spanish", "german")


@pytest.mark.parametrize("language", sorted(set(LANGUAGES) - set(LESS_ACCENTED)))
def test_accented_latin_and_georgian_count_at_least_as_cl100k_does(language: str) -> None:
    """Counted at 63-88% of cl100k's count before (Georgian 49%): at least it now over the sentences, no
    sentence under 80% of it, and at least o200k's count each."""
    est = RoughEstimator()
    sentences = LANGUAGES[language]
    assert sum(est.count_text(t) for t, _, _ in sentences) >= sum(cl100k for _, cl100k, _ in sentences)
    for text, cl100k, o200k in sentences:
        assert est.count_text(text) >= max(0.8 * cl100k, o200k), (text, cl100k)


@pytest.mark.parametrize("language", LESS_ACCENTED)
def test_french_spanish_german_stay_modestly_high(language: str) -> None:
    """The higher rates of accented letters keep the languages with few of them at or above cl100k's count,
    not far above it (these sentences are among the most overcounted: +10% to +16% is the median)."""
    est = RoughEstimator()
    for text, cl100k, o200k in LANGUAGES[language]:
        assert max(cl100k, o200k) <= est.count_text(text) <= 1.5 * cl100k, (text, cl100k)


def test_ascii_counts_do_not_change() -> None:
    """ASCII text takes no part in the change: its counts are the ones pinned before."""
    est = RoughEstimator()
    assert est.count_text("plain words, 42 of them!") == 7
    assert est.count_text("The quick brown fox jumps over the lazy dog.") == 12
    assert est.count_text(json.dumps({"path": "/tmp/a.txt", "lines": [1, 2, 3]})) == 17
    # Latin-1 signs and spaces (guillemets, degree, copyright, no-break spaces) stay at about a token each.
    assert est.count_text("« Bonjour » 20 °C, © 2024, 3 × 4") == 15  # noqa: RUF001


def test_counts_grow_with_the_text() -> None:
    """A prefix never counts more than the text it begins (the budget fitting cuts texts by bisection)."""
    est = RoughEstimator()
    text = " ".join(t for sentences in LANGUAGES.values() for t, _, _ in sentences)
    counts = [est.count_text(text[:i]) for i in range(0, len(text) + 1, 7)]
    assert counts == sorted(counts)
