//! Secrets for the security tests: a tokens file with one token per role, and a CA that signs
//! loopback certificates.

use std::path::{Path, PathBuf};

pub const READ: &str = "read-token-0123456789abcdef";
pub const SUBMIT: &str = "submit-token-0123456789abcdef";
pub const ADMIN: &str = "admin-token-0123456789abcdef";
pub const PEER: &str = "peer-token-0123456789abcdef";

pub fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

/// A tokens file with one token per role, and one token file per caller.
pub fn tokens(dir: &Path) -> PathBuf {
    for (name, token) in [("read", READ), ("submit", SUBMIT), ("admin", ADMIN)] {
        write(dir, &format!("{name}.token"), &format!("{token}\n"));
    }
    write(dir, "peer.token", PEER);
    let peer_digest: String = baton::security::digest(PEER)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    write(
        dir,
        "tokens",
        &format!(
            "# role per token\n{READ} read viewer\n{SUBMIT} submit ci\n{ADMIN} admin ops\nsha256:{peer_digest} admin coordinators\n"
        ),
    )
}

/// A CA, and certificates it signs for loopback (server and client use).
pub struct Ca {
    cert: rcgen::Certificate,
    key: rcgen::KeyPair,
}

impl Ca {
    pub fn new(name: &str) -> Ca {
        let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        p.distinguished_name.push(rcgen::DnType::CommonName, name);
        p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        p.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::DigitalSignature,
        ];
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = p.self_signed(&key).unwrap();
        Ca { cert, key }
    }

    pub fn save(&self, dir: &Path, name: &str) -> PathBuf {
        write(dir, name, &self.cert.pem())
    }

    /// Writes `<name>.pem` and `<name>.key` (by rename, as a rotation would).
    pub fn issue(&self, dir: &Path, name: &str, cn: &str) -> (PathBuf, PathBuf) {
        let mut p =
            rcgen::CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()])
                .unwrap();
        p.distinguished_name.push(rcgen::DnType::CommonName, cn);
        p.extended_key_usages = vec![
            rcgen::ExtendedKeyUsagePurpose::ServerAuth,
            rcgen::ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = p.signed_by(&key, &self.cert, &self.key).unwrap();
        let (c, k) = (
            dir.join(format!("{name}.pem")),
            dir.join(format!("{name}.key")),
        );
        let tmp = write(dir, ".tmp-key", &key.serialize_pem());
        std::fs::rename(tmp, &k).unwrap();
        let tmp = write(dir, ".tmp-cert", &cert.pem());
        std::fs::rename(tmp, &c).unwrap();
        (c, k)
    }
}
