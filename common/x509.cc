// X.509 keys, requests and certificates on OpenSSL (see x509.h).
#include "common/x509.h"

#include <arpa/inet.h>
#include <openssl/asn1.h>
#include <openssl/bio.h>
#include <openssl/bn.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/rand.h>
#include <openssl/sha.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>

#include <memory>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace spindle {
namespace {

template <typename T, void (*F)(T*)>
struct Deleter {
  void operator()(T* p) const { F(p); }
};
using Bio = std::unique_ptr<BIO, Deleter<BIO, BIO_free_all>>;
using Key = std::unique_ptr<EVP_PKEY, Deleter<EVP_PKEY, EVP_PKEY_free>>;
using Req = std::unique_ptr<X509_REQ, Deleter<X509_REQ, X509_REQ_free>>;
using Cert = std::unique_ptr<X509, Deleter<X509, X509_free>>;
using Name = std::unique_ptr<X509_NAME, Deleter<X509_NAME, X509_NAME_free>>;
using Bn = std::unique_ptr<BIGNUM, Deleter<BIGNUM, BN_free>>;
using Store = std::unique_ptr<X509_STORE, Deleter<X509_STORE, X509_STORE_free>>;
using StoreCtx = std::unique_ptr<X509_STORE_CTX, Deleter<X509_STORE_CTX, X509_STORE_CTX_free>>;

// The reason OpenSSL queued for its last failure (the queue is emptied).
std::string OpenSslError() {
  unsigned long code = 0, last = 0;
  while ((code = ERR_get_error()) != 0) last = code;
  if (last == 0) return "unknown OpenSSL error";
  char buf[256];
  ERR_error_string_n(last, buf, sizeof(buf));
  return buf;
}

Bio ReadBio(const std::string& text) {
  return Bio(BIO_new_mem_buf(text.data(), static_cast<int>(text.size())));
}

std::string BioText(BIO* bio) {
  char* data = nullptr;
  const long n = BIO_get_mem_data(bio, &data);
  return n > 0 ? std::string(data, static_cast<size_t>(n)) : std::string();
}

absl::StatusOr<Key> ReadPrivateKey(const std::string& pem) {
  Bio bio = ReadBio(pem);
  Key key(PEM_read_bio_PrivateKey(bio.get(), nullptr, nullptr, nullptr));
  if (!key) return absl::InvalidArgumentError("not a PEM private key: " + OpenSslError());
  return key;
}

absl::StatusOr<Key> ReadPublicKey(const std::string& pem) {
  Bio bio = ReadBio(pem);
  Key key(PEM_read_bio_PUBKEY(bio.get(), nullptr, nullptr, nullptr));
  if (!key) return absl::InvalidArgumentError("not a PEM public key: " + OpenSslError());
  return key;
}

absl::StatusOr<Cert> ReadCert(const std::string& pem) {
  Bio bio = ReadBio(pem);
  Cert cert(PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr));
  if (!cert) return absl::InvalidArgumentError("not a PEM certificate: " + OpenSslError());
  return cert;
}

std::string PublicKeyPem(EVP_PKEY* key) {
  Bio out(BIO_new(BIO_s_mem()));
  if (PEM_write_bio_PUBKEY(out.get(), key) != 1) return "";
  return BioText(out.get());
}

std::vector<std::string> NameEntries(const X509_NAME* name, int nid) {
  std::vector<std::string> out;
  for (int i = X509_NAME_get_index_by_NID(name, nid, -1); i >= 0;
       i = X509_NAME_get_index_by_NID(name, nid, i)) {
    const ASN1_STRING* s = X509_NAME_ENTRY_get_data(X509_NAME_get_entry(name, i));
    unsigned char* utf8 = nullptr;
    const int n = ASN1_STRING_to_UTF8(&utf8, s);
    if (n < 0) continue;
    out.emplace_back(reinterpret_cast<char*>(utf8), static_cast<size_t>(n));
    OPENSSL_free(utf8);
  }
  return out;
}

int64_t AsnTimeToUnix(const ASN1_TIME* t) {
  struct tm tm = {};
  if (ASN1_TIME_to_tm(t, &tm) != 1) return 0;
  return static_cast<int64_t>(timegm(&tm));
}

bool AddExtension(X509* cert, X509* issuer, int nid, const std::string& value) {
  X509V3_CTX ctx;
  X509V3_set_ctx_nodb(&ctx);
  X509V3_set_ctx(&ctx, issuer, cert, nullptr, nullptr, 0);
  X509_EXTENSION* ext = X509V3_EXT_conf_nid(nullptr, &ctx, nid, value.c_str());
  if (ext == nullptr) return false;
  const bool ok = X509_add_ext(cert, ext, -1) == 1;
  X509_EXTENSION_free(ext);
  return ok;
}

}  // namespace

absl::StatusOr<std::string> GeneratePrivateKey() {
  Key key(EVP_EC_gen("P-256"));
  if (!key) return absl::InternalError("cannot generate an EC key: " + OpenSslError());
  Bio out(BIO_new(BIO_s_mem()));
  if (PEM_write_bio_PrivateKey(out.get(), key.get(), nullptr, nullptr, 0, nullptr, nullptr) != 1)
    return absl::InternalError("cannot write a private key: " + OpenSslError());
  return BioText(out.get());
}

absl::StatusOr<std::string> PublicKeyOf(const std::string& key_pem) {
  absl::StatusOr<Key> key = ReadPrivateKey(key_pem);
  if (!key.ok()) return key.status();
  return PublicKeyPem(key->get());
}

absl::StatusOr<std::string> MakeCertificateRequest(const std::string& key_pem,
                                                   const std::string& common_name) {
  absl::StatusOr<Key> key = ReadPrivateKey(key_pem);
  if (!key.ok()) return key.status();
  Req req(X509_REQ_new());
  X509_NAME* name = X509_REQ_get_subject_name(req.get());
  if (X509_NAME_add_entry_by_NID(name, NID_commonName, MBSTRING_UTF8,
                                 reinterpret_cast<const unsigned char*>(common_name.c_str()),
                                 static_cast<int>(common_name.size()), -1, 0) != 1 ||
      X509_REQ_set_pubkey(req.get(), key->get()) != 1 ||
      X509_REQ_sign(req.get(), key->get(), EVP_sha256()) <= 0)
    return absl::InvalidArgumentError("cannot make a certificate request: " + OpenSslError());
  Bio out(BIO_new(BIO_s_mem()));
  if (PEM_write_bio_X509_REQ(out.get(), req.get()) != 1)
    return absl::InternalError("cannot write a certificate request: " + OpenSslError());
  return BioText(out.get());
}

absl::StatusOr<CertificateRequestInfo> ParseCertificateRequest(const std::string& csr_pem) {
  Bio bio = ReadBio(csr_pem);
  Req req(PEM_read_bio_X509_REQ(bio.get(), nullptr, nullptr, nullptr));
  if (!req) {
    ERR_clear_error();
    return absl::InvalidArgumentError("the certificate request is not a PEM CERTIFICATE REQUEST");
  }
  EVP_PKEY* key = X509_REQ_get0_pubkey(req.get());
  if (key == nullptr || X509_REQ_verify(req.get(), key) != 1) {
    ERR_clear_error();
    return absl::InvalidArgumentError("the certificate request's signature does not verify");
  }
  const std::vector<std::string> cns =
      NameEntries(X509_REQ_get_subject_name(req.get()), NID_commonName);
  if (cns.size() != 1)
    return absl::InvalidArgumentError(absl::StrCat("the certificate request's subject has ",
                                                   cns.size(), " common names; expected one"));
  CertificateRequestInfo info;
  info.common_name = cns[0];
  info.public_key_pem = PublicKeyPem(key);
  return info;
}

absl::StatusOr<std::string> IssueCertificate(const CertificateTemplate& t,
                                             const std::string& issuer_cert_pem,
                                             const std::string& issuer_key_pem,
                                             std::string* serial_hex) {
  absl::StatusOr<Key> issuer_key = ReadPrivateKey(issuer_key_pem);
  if (!issuer_key.ok()) return issuer_key.status();
  absl::StatusOr<Key> subject_key = ReadPublicKey(t.public_key_pem);
  if (!subject_key.ok()) return subject_key.status();
  Cert issuer;
  if (!issuer_cert_pem.empty()) {
    absl::StatusOr<Cert> c = ReadCert(issuer_cert_pem);
    if (!c.ok()) return c.status();
    issuer = *std::move(c);
  }
  Cert cert(X509_new());
  X509_set_version(cert.get(), 2);  // v3
  unsigned char serial_bytes[16];
  if (RAND_bytes(serial_bytes, sizeof(serial_bytes)) != 1)
    return absl::InternalError("no random serial: " + OpenSslError());
  serial_bytes[0] &= 0x7f;  // positive
  serial_bytes[0] |= 0x40;  // and of full length
  Bn serial(BN_bin2bn(serial_bytes, sizeof(serial_bytes), nullptr));
  BN_to_ASN1_INTEGER(serial.get(), X509_get_serialNumber(cert.get()));
  if (serial_hex != nullptr) {
    char* hex = BN_bn2hex(serial.get());
    *serial_hex = hex;
    OPENSSL_free(hex);
  }
  ASN1_TIME_set(X509_getm_notBefore(cert.get()), static_cast<time_t>(t.not_before_unix_s));
  ASN1_TIME_set(X509_getm_notAfter(cert.get()), static_cast<time_t>(t.not_after_unix_s));
  X509_NAME* name = X509_get_subject_name(cert.get());
  if (!t.organization.empty())
    X509_NAME_add_entry_by_NID(name, NID_organizationName, MBSTRING_UTF8,
                               reinterpret_cast<const unsigned char*>(t.organization.c_str()),
                               static_cast<int>(t.organization.size()), -1, 0);
  X509_NAME_add_entry_by_NID(name, NID_commonName, MBSTRING_UTF8,
                             reinterpret_cast<const unsigned char*>(t.common_name.c_str()),
                             static_cast<int>(t.common_name.size()), -1, 0);
  X509_set_issuer_name(cert.get(), issuer ? X509_get_subject_name(issuer.get()) : name);
  X509_set_pubkey(cert.get(), subject_key->get());
  X509* issuer_for_ext = issuer ? issuer.get() : cert.get();
  bool ok = AddExtension(cert.get(), issuer_for_ext, NID_subject_key_identifier, "hash") &&
            AddExtension(cert.get(), issuer_for_ext, NID_authority_key_identifier, "keyid:always");
  switch (t.usage) {
    case CertificateUsage::kAuthority:
      ok = ok &&
           AddExtension(cert.get(), issuer_for_ext, NID_basic_constraints, "critical,CA:TRUE") &&
           AddExtension(cert.get(), issuer_for_ext, NID_key_usage, "critical,keyCertSign,cRLSign");
      break;
    case CertificateUsage::kServer:
    case CertificateUsage::kClient:
      ok = ok &&
           AddExtension(cert.get(), issuer_for_ext, NID_basic_constraints, "critical,CA:FALSE") &&
           AddExtension(cert.get(), issuer_for_ext, NID_key_usage,
                        "critical,digitalSignature,keyEncipherment") &&
           AddExtension(cert.get(), issuer_for_ext, NID_ext_key_usage,
                        t.usage == CertificateUsage::kServer ? "serverAuth" : "clientAuth");
      break;
  }
  if (!ok) return absl::InternalError("cannot add certificate extensions: " + OpenSslError());
  std::string sans;
  for (const std::string& d : t.dns_names)
    absl::StrAppend(&sans, sans.empty() ? "" : ",", "DNS:", d);
  for (const std::string& ip : t.ip_addresses) {
    unsigned char buf[16];
    if (inet_pton(AF_INET, ip.c_str(), buf) != 1 && inet_pton(AF_INET6, ip.c_str(), buf) != 1)
      return absl::InvalidArgumentError(absl::StrCat("\"", ip, "\" is not an IP address"));
    absl::StrAppend(&sans, sans.empty() ? "" : ",", "IP:", ip);
  }
  if (!sans.empty() && !AddExtension(cert.get(), issuer_for_ext, NID_subject_alt_name, sans))
    return absl::InvalidArgumentError(
        absl::StrCat("cannot add the names ", sans, ": ", OpenSslError()));
  if (X509_sign(cert.get(), issuer_key->get(), EVP_sha256()) <= 0)
    return absl::InvalidArgumentError("cannot sign the certificate: " + OpenSslError());
  Bio out(BIO_new(BIO_s_mem()));
  if (PEM_write_bio_X509(out.get(), cert.get()) != 1)
    return absl::InternalError("cannot write the certificate: " + OpenSslError());
  return BioText(out.get());
}

absl::StatusOr<CertificateInfo> ParseCertificate(const std::string& cert_pem) {
  absl::StatusOr<Cert> cert = ReadCert(cert_pem);
  if (!cert.ok()) {
    ERR_clear_error();
    return absl::InvalidArgumentError("not a PEM certificate");
  }
  CertificateInfo info;
  const X509_NAME* subject = X509_get_subject_name(cert->get());
  info.common_names = NameEntries(subject, NID_commonName);
  info.organizations = NameEntries(subject, NID_organizationName);
  char line[512];
  X509_NAME_oneline(X509_get_issuer_name(cert->get()), line, sizeof(line));
  info.issuer = line;
  Bn serial(ASN1_INTEGER_to_BN(X509_get0_serialNumber(cert->get()), nullptr));
  if (serial) {
    char* hex = BN_bn2hex(serial.get());
    info.serial_hex = hex;
    OPENSSL_free(hex);
  }
  info.not_before_unix_s = AsnTimeToUnix(X509_get0_notBefore(cert->get()));
  info.not_after_unix_s = AsnTimeToUnix(X509_get0_notAfter(cert->get()));
  return info;
}

absl::Status CheckCertificate(const std::string& cert_pem, const std::string& ca_cert_pem,
                              const std::string& key_pem) {
  absl::StatusOr<Cert> cert = ReadCert(cert_pem);
  absl::StatusOr<Cert> ca = ReadCert(ca_cert_pem);
  if (!cert.ok() || !ca.ok()) {
    ERR_clear_error();
    return absl::FailedPreconditionError(!cert.ok() ? "the certificate is not PEM"
                                                    : "the CA certificate is not PEM");
  }
  Store store(X509_STORE_new());
  X509_STORE_add_cert(store.get(), ca->get());
  StoreCtx ctx(X509_STORE_CTX_new());
  X509_STORE_CTX_init(ctx.get(), store.get(), cert->get(), nullptr);
  if (X509_verify_cert(ctx.get()) != 1) {
    const int err = X509_STORE_CTX_get_error(ctx.get());
    ERR_clear_error();
    return absl::FailedPreconditionError(absl::StrCat(
        "the certificate does not verify against the CA: ", X509_verify_cert_error_string(err)));
  }
  if (!key_pem.empty()) {
    absl::StatusOr<Key> key = ReadPrivateKey(key_pem);
    if (!key.ok() || X509_check_private_key(cert->get(), key->get()) != 1) {
      ERR_clear_error();
      return absl::FailedPreconditionError("the private key does not belong to the certificate");
    }
  }
  return absl::OkStatus();
}

std::string Sha256Hex(const std::string& data) {
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(data.data()), data.size(), digest);
  std::string out;
  for (unsigned char b : digest) absl::StrAppendFormat(&out, "%02x", b);
  return out;
}

}  // namespace spindle
