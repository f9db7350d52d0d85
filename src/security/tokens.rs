//! The bearer tokens file: one `token role [name]` per line (`#` comments, blank lines).
//!
//! Only SHA-256 digests are kept in memory; a line may give the digest itself
//! (`sha256:<64 hex digits>`), so the file need not hold a usable secret. Lookups compare
//! digests in constant time and never log a token or where it differed.

use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use super::Role;

/// Plain tokens shorter than this are refused: they could be guessed.
pub const MIN_TOKEN_LEN: usize = 16;

#[derive(Debug)]
struct Entry {
    digest: [u8; 32],
    role: Role,
    name: String,
}

/// The parsed file.
#[derive(Debug, Default)]
pub struct TokenTable {
    entries: Vec<Entry>,
}

pub fn digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

fn hex_digest(s: &str) -> Option<[u8; 32]> {
    if s.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

impl TokenTable {
    /// Errors name the line, never its token.
    pub fn parse(text: &str) -> Result<TokenTable, String> {
        let mut entries = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let n = n + 1;
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let mut fields = line.split_whitespace();
            let (Some(token), Some(role)) = (fields.next(), fields.next()) else {
                return Err(format!("line {n}: expected `token role [name]`"));
            };
            let role: Role = role.parse().map_err(|e| format!("line {n}: {e}"))?;
            let name = fields.next();
            if fields.next().is_some() {
                return Err(format!(
                    "line {n}: expected `token role [name]`, found more fields"
                ));
            }
            let digest = match token.strip_prefix("sha256:") {
                Some(hex) => hex_digest(hex)
                    .ok_or_else(|| format!("line {n}: sha256: needs 64 hex digits"))?,
                None if token.len() < MIN_TOKEN_LEN => {
                    return Err(format!(
                        "line {n}: the token is shorter than {MIN_TOKEN_LEN} characters"
                    ))
                }
                None => digest(token),
            };
            let name = match name {
                Some(n) => n.to_string(),
                // Not from the digest: names are shown to every reader, and digest bits
                // would help guess a weak token offline.
                None => format!("token-line-{n}"),
            };
            entries.push(Entry { digest, role, name });
        }
        Ok(TokenTable { entries })
    }

    pub fn read(path: &std::path::Path) -> Result<TokenTable, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        Self::parse(&text).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// The name and role of `token`, comparing against every entry so the time taken says
    /// nothing about which one matched or how close a guess was.
    pub fn lookup(&self, token: &str) -> Option<(&str, Role)> {
        let d = digest(token);
        let mut found = None;
        for e in &self.entries {
            if bool::from(e.digest.ct_eq(&d)) && found.is_none() {
                found = Some((e.name.as_str(), e.role));
            }
        }
        found
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_give_roles_names_and_digests() {
        let hashed = "b".repeat(20);
        let hex: String = digest(&hashed).iter().map(|b| format!("{b:02x}")).collect();
        let t = TokenTable::parse(&format!(
            "# ops\n\n{} read alice\n{} admin\nsha256:{hex} submit ci\n",
            "a".repeat(20),
            "c".repeat(16)
        ))
        .unwrap();
        assert_eq!(t.len(), 3);
        assert_eq!(t.lookup(&"a".repeat(20)), Some(("alice", Role::Read)));
        assert_eq!(t.lookup(&hashed), Some(("ci", Role::Submit)));
        let (name, role) = t.lookup(&"c".repeat(16)).unwrap();
        assert!(name.starts_with("token-"));
        assert_eq!(role, Role::Admin);
        assert_eq!(t.lookup("a"), None);
        assert_eq!(t.lookup(""), None);
    }

    #[test]
    fn bad_lines_are_refused_without_echoing_the_token() {
        for bad in [
            "secretsecretsecret\n",
            "secretsecretsecret root\n",
            "short read\n",
            "secretsecretsecret read a b\n",
            "sha256:abc read\n",
        ] {
            let e = TokenTable::parse(bad).unwrap_err();
            assert!(e.starts_with("line 1:"), "{e}");
            assert!(!e.contains("secret"), "{e}");
        }
    }
}
